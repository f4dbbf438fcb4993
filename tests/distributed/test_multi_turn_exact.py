"""Multi-turn rows train exactly on every sequence layout: a batch whose response masks have holes (tool
output and template tokens between the policy's turns: attended to, never trained on) gives the same loss
metrics, gradients and AdamW step at Ulysses 2, ring 2 and Ulysses 2 x ring 2, with fixed-size and
token-budget micro-batches, as on one rank (fp32, CPU, gloo)."""

from __future__ import annotations

import pytest
from _launch import run_distributed
from test_fsdp_engine import B, R, _assert_same_step, _rollout_batch, _train_once

from rlsp.data.batch import Batch
from rlsp.models.tiny import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.distributed


def _multi_turn(batch: Batch) -> Batch:
    """Punch observation segments into every response: tokens 2-4 and 7-8 of each turn-structured row
    become mask 0 (still attended), as an agent loop's tool turns are."""
    mask = batch["response_mask"].clone()
    for b in range(B):
        holes = [t for t in (2, 3, 4, 7, 8) if t < R and mask[b, t] > 0 and b % 3 != 2]  # some rows single-turn
        mask[b, holes] = 0.0
    for name in ("old_logprobs", "ref_logprobs", "advantages"):
        batch.set(name, batch[name] * mask)
    batch.set("response_mask", mask)
    return batch


@pytest.fixture(scope="module")
def model_and_batch(tmp_path_factory):
    path = build_tiny_model(TinyModelSpec(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                          num_key_value_heads=2), str(tmp_path_factory.mktemp("tiny")))
    from transformers import AutoConfig

    batch = _multi_turn(_rollout_batch(AutoConfig.from_pretrained(path).vocab_size, seed=3))
    assert (batch["attention_mask"][:, -R:].sum() > batch["response_mask"].sum())  # holes exist
    reference = run_distributed(_train_once, 1, path, 1, B, batch)[0]
    return path, batch, reference


@pytest.mark.parametrize("world,ulysses,ring,micro,max_tokens", [
    (2, 2, 1, 3, None), (2, 1, 2, 2, None), (4, 2, 2, 3, None), (4, 2, 2, B, 24)])
def test_multi_turn_rows_are_exact_on_every_sequence_layout(model_and_batch, world, ulysses, ring, micro, max_tokens):
    path, batch, reference = model_and_batch
    got = run_distributed(_train_once, world, path, ulysses, micro, batch, max_tokens, -1, ring)[0]
    _assert_same_step(got, reference, path)


def test_holes_change_the_step(model_and_batch):
    """The masks matter: training the same rows with their holes filled gives another step."""
    path, batch, (_, ref_grads, _) = model_and_batch
    filled = Batch(batch.tensors.clone(), dict(batch.meta), dict(batch.info))
    filled.set("response_mask", (filled["attention_mask"][:, -R:] > 0).float())
    _, grads, _ = run_distributed(_train_once, 1, path, 1, B, filled)[0]
    worst = max(float((grads[k] - ref_grads[k]).norm() / ref_grads[k].norm().clamp_min(1e-30)) for k in grads)
    assert worst > 1e-2, worst
