"""Policy losses beyond "vanilla" in the actor loss are exact under data and Ulysses sequence parallelism.

Reference per loss: one process (world=1, sp=1, one micro-batch), computed once per module. dp=2 and
Ulysses sp=2 (with micro-batching) must reproduce its loss metrics, every full gradient and the AdamW
step, as tests/distributed/test_fsdp_engine.py proves for "vanilla". The sequence-level losses (gspo,
geo_mean) are the point: their row statistics come from the loss context, across the shards of a row.
"""

from __future__ import annotations

import dataclasses

import pytest
from _launch import run_distributed
from test_fsdp_engine import LOSS, METRICS, B, _assert_same_step, _rel, _rollout_batch, _train_once

from rlsp.models.tiny import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.distributed

# name -> ActorLossConfig fields: the loss's keywords (wide enough that the test batch's ratios land on both
# sides of the clip) and, for the sequence-level losses, the aggregation their papers use.
LOSSES = {
    "cispo": {},
    "gpg": {},
    "gspo": {"loss_kwargs": {"clip_ratio_low": 0.65, "clip_ratio_high": 0.5}, "loss_agg_mode": "seq-mean-token-mean"},
    "geo_mean": {"loss_kwargs": {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4}, "loss_agg_mode": "seq-mean-token-mean"},
    "sapo": {"loss_kwargs": {"tau_pos": 1.0, "tau_neg": 1.05}},
}
# (world, ulysses, micro-batch size): dp 2 with two micro-batches per rank; Ulysses 2 with ragged micro-batches.
LAYOUTS = [(2, 1, 2), (2, 2, 3)]


def _run(path: str, batch, world: int, sp: int, micro: int, policy_loss: str):
    loss = dataclasses.replace(LOSS, policy_loss=policy_loss, **LOSSES[policy_loss])
    return run_distributed(_train_once, world, path, sp, micro, batch, None, -1, 1, 1, True, loss)[0]


@pytest.fixture(scope="module")
def model_and_refs(tmp_path_factory):
    path = build_tiny_model(TinyModelSpec(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                          num_key_value_heads=2), str(tmp_path_factory.mktemp("tiny")))
    from transformers import AutoConfig

    batch = _rollout_batch(AutoConfig.from_pretrained(path).vocab_size)
    refs = {name: _run(path, batch, 1, 1, B, name) for name in LOSSES}
    return path, batch, refs


def test_references_differ_and_report_verl_metrics(model_and_refs) -> None:
    _, _, refs = model_and_refs
    for name in LOSSES:
        others = [refs[o][1] for o in LOSSES if o != name]
        assert all(max(_rel(refs[name][1][k], grads[k]) for k in grads) > 1e-3 for grads in others), name
    (cispo_metrics, cispo_grads, _), (gpg_metrics, gpg_grads, _) = refs["cispo"], refs["gpg"]
    assert cispo_metrics["actor/pg_loss"] != gpg_metrics["actor/pg_loss"]
    assert max(_rel(cispo_grads[k], gpg_grads[k]) for k in gpg_grads) > 1e-3
    assert {"actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"} <= cispo_metrics.keys()
    assert cispo_metrics["actor/pg_clipfrac_lower"] == 0.0
    assert not {"actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"} & gpg_metrics.keys()
    # The clip ranges above bind for some tokens and not others (else the gradient check would be weak).
    for name in ("gspo", "geo_mean"):
        assert 0.0 < refs[name][0]["actor/pg_clipfrac"] < 1.0, (name, refs[name][0])


@pytest.mark.parametrize("world,sp,micro", LAYOUTS)
@pytest.mark.parametrize("policy_loss", LOSSES)
def test_loss_gradients_and_step_match_one_rank(model_and_refs, policy_loss: str, world: int, sp: int,
                                                micro: int) -> None:
    path, batch, refs = model_and_refs
    got = _run(path, batch, world, sp, micro, policy_loss)
    extra = [key for key in ("actor/pg_clipfrac", "actor/ppo_kl") if key in refs[policy_loss][0]]
    assert [key for key in ("actor/pg_clipfrac", "actor/ppo_kl") if key in got[0]] == extra
    _assert_same_step(got, refs[policy_loss], path, METRICS + tuple(extra))


@pytest.mark.parametrize("ring,tp", [(2, 1), (1, 2)])
@pytest.mark.parametrize("policy_loss", ["gspo", "geo_mean"])
def test_sequence_losses_match_one_rank_under_ring_and_tensor_parallelism(model_and_refs, policy_loss: str, ring: int,
                                                                          tp: int) -> None:
    """A row split over ring ranks, or over tp ranks' sequence-parallel blocks, still reads its whole-row
    statistics through the loss context."""
    path, batch, refs = model_and_refs
    loss = dataclasses.replace(LOSS, policy_loss=policy_loss, **LOSSES[policy_loss])
    got = run_distributed(_train_once, 2, path, 1, 3, batch, None, -1, ring, tp, True, loss)[0]
    _assert_same_step(got, refs[policy_loss], path, METRICS + ("actor/pg_clipfrac", "actor/ppo_kl"))
