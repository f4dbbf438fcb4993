"""clip_cov, kl_cov, dppo_tv and bypass_mode (reinforce, sequence weights, row rejection) in the actor loss are
exact under data parallelism and Ulysses sequence parallelism.

clip_cov / kl_cov take their statistics per micro-batch and bypass_mode corrects per micro-batch, so the
reference is one process with the *same micro-batches* (world=1, sp=1, micro-batch size m): dp 2 with
m = 2 splits the rows [0..3] / [4..7] into the same pairs, Ulysses 2 with m = 3 shards every micro-batch's
tokens across two ranks. Each must reproduce the reference's loss metrics, every full gradient and the
AdamW step within the bounds tests/tolerances.py derives (test_fsdp_engine's `_assert_same_step`). One
launch per layout runs every loss (a fresh engine each); bypass_mode also runs without its row
rejection, to show the rejection changes the loss.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from _launch import run_distributed
from test_fsdp_engine import LOSS, METRICS, _assert_same_step, _rollout_batch, _train_once

from rlsp.models.tiny import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.distributed

BYPASS = {"loss_type": "reinforce", "rollout_is": "sequence", "rollout_is_threshold": 2.0,
          "rollout_is_batch_normalize": True, "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.9_1.1",
          "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}
LOSSES = {
    # Wide covariance window and large shares, so that every micro-batch picks several tokens.
    "clip_cov": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_cov_ratio": 0.3, "clip_cov_lb": 0.0,
                 "clip_cov_ub": 100.0},
    "kl_cov": {"kl_cov_ratio": 0.3, "ppo_kl_coef": 1.0},
    "dppo_tv": {"clip_ratio_low": 0.002, "clip_ratio_high": 0.002, "clip_ratio_c": 1.2},
    "bypass_mode": BYPASS,
    "bypass_mode/no_rs": {**BYPASS, "rollout_rs": None, "rollout_rs_threshold": None},
}
LAYOUTS = [(2, 1, 2), (2, 2, 3)]  # (world, ulysses, micro-batch size)
OPTIONAL = ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl")  # metrics only some losses report


def _train_all(rank: int, world: int, path: str, sp: int, micro: int, batch) -> dict | None:
    out = {}
    for label, kwargs in LOSSES.items():
        loss = dataclasses.replace(LOSS, policy_loss=label.partition("/")[0], loss_kwargs=kwargs)
        out[label] = _train_once(rank, world, path, sp, micro, batch, None, -1, 1, 1, True, loss)
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def model_and_refs(tmp_path_factory):
    path = build_tiny_model(TinyModelSpec(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                          num_key_value_heads=2), str(tmp_path_factory.mktemp("tiny")))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    batch = _rollout_batch(vocab)
    # Old (= rollout) logprobs near the near-uniform tiny policy's, so ratios, clips and rejections are mixed.
    g = torch.Generator().manual_seed(1)
    noise = 0.3 * torch.randn(batch["old_logprobs"].shape, generator=g)
    batch.set("old_logprobs", (noise - math.log(vocab)) * batch["response_mask"])
    refs = {micro: run_distributed(_train_all, 1, path, 1, micro, batch)[0] for _, _, micro in LAYOUTS}
    return path, batch, refs


def test_references_are_not_trivial(model_and_refs) -> None:
    _, _, refs = model_and_refs
    for micro, ref in refs.items():
        metrics = {name: ref[name][0] for name in LOSSES}
        assert 0.0 < metrics["clip_cov"]["actor/pg_clipfrac"] < 1.0, (micro, metrics["clip_cov"])
        assert metrics["kl_cov"]["actor/ppo_kl"] > 0.0
        assert 0.0 < metrics["dppo_tv"]["actor/pg_clipfrac"] < 1.0, (micro, metrics["dppo_tv"])
        losses = [metrics[name]["actor/pg_loss"] for name in LOSSES]
        assert len(set(losses)) == len(losses) and 0.0 not in losses  # seq_mean_k1 rejects some rows, not all
    # The covariance statistics are per micro-batch: other micro-batches, other picks.
    assert refs[2]["clip_cov"][0]["actor/pg_loss"] != refs[3]["clip_cov"][0]["actor/pg_loss"]


@pytest.mark.parametrize("world,sp,micro", LAYOUTS)
def test_layout_matches_one_rank_with_the_same_micro_batches(model_and_refs, world: int, sp: int, micro: int) -> None:
    path, batch, refs = model_and_refs
    got = run_distributed(_train_all, world, path, sp, micro, batch)[0]
    for name in LOSSES:
        ref = refs[micro][name]
        extra = tuple(key for key in OPTIONAL if key in ref[0])
        assert tuple(key for key in OPTIONAL if key in got[name][0]) == extra, name
        _assert_same_step(got[name], ref, path, METRICS + extra)

