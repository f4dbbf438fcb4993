"""Masked helpers, loss aggregation modes, and the micro-batch-invariance of global token-mean."""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import assert_grads_close, roundoff_rtol

from rlsp.algos.aggregation import (
    AGGREGATION_MODES,
    LossScale,
    aggregate_loss,
    aggregate_token_mean,
    compute_token_weights,
    count_sequences,
    group_mean_std,
    loss_divisor,
    masked_mean,
    masked_sum,
    masked_whiten,
)
from rlsp.algos.policy_loss import compute_ppo_clip_loss
from rlsp.config.choices import LOSS_AGG_MODES

F64 = torch.float64

VALUES = torch.tensor([[1.0, 2.0, float("nan")], [4.0, 0.0, 0.0]], dtype=F64)
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=F64)


def test_masked_sum_mean_whiten_hand_values() -> None:
    assert masked_sum(VALUES, MASK).item() == 7.0
    torch.testing.assert_close(masked_sum(VALUES, MASK, dim=-1), torch.tensor([3.0, 4.0], dtype=F64))
    assert masked_mean(VALUES, MASK).item() == pytest.approx(7.0 / 5.0, abs=1e-15)
    torch.testing.assert_close(masked_mean(VALUES, MASK, dim=-1), torch.tensor([1.5, 4.0 / 3.0], dtype=F64))
    assert masked_mean(VALUES, torch.zeros_like(MASK)).item() == 0.0
    # Values [1, 2, 4, 0, 0]: mean 1.4, squared deviations 11.2, unbiased var 2.8.
    expected = torch.tensor([[-0.4, 0.6, 0.0], [2.6, -1.4, -1.4]], dtype=F64) / math.sqrt(2.8)
    torch.testing.assert_close(masked_whiten(VALUES, MASK, eps=0.0), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(
        masked_whiten(VALUES, MASK, shift_mean=False, eps=0.0), (expected + 1.4) * MASK, rtol=0, atol=1e-12
    )


def test_group_mean_std_hand_values() -> None:
    mean, std, count = group_mean_std(torch.tensor([1.0, 5.0, 3.0, 7.0], dtype=F64), ["g", "h", "g", "solo"])
    torch.testing.assert_close(mean, torch.tensor([2.0, 0.0, 2.0, 0.0], dtype=F64))
    torch.testing.assert_close(std, torch.tensor([math.sqrt(2.0), 1.0, math.sqrt(2.0), 1.0], dtype=F64))
    torch.testing.assert_close(count, torch.tensor([2.0, 1.0, 2.0, 1.0], dtype=F64))
    with pytest.raises(ValueError, match="group id per row"):
        group_mean_std(torch.zeros(3), ["a", "b"])


def test_aggregation_modes_hand_values() -> None:
    loss = torch.tensor([[1.0, 3.0, 9.0], [2.0, 2.0, 2.0]], dtype=F64)

    def agg(mode: str, **counts: float) -> float:
        return aggregate_loss(loss, MASK, LossScale(mode, **counts)).item()

    # token-mean: 10 / global count 8 (other micro-batches hold the rest of the tokens).
    assert agg("token-mean", global_tokens=8) == pytest.approx(10 / 8)
    assert aggregate_token_mean(loss, MASK, torch.tensor(8.0)).item() == pytest.approx(10 / 8)
    # Row sums 4 and 6, row lengths 2 and 3, 4 sequences in the mini-batch.
    assert agg("seq-mean-token-sum", global_seqs=4) == pytest.approx((4 + 6) / 4)
    assert agg("seq-mean-token-mean", global_seqs=4) == pytest.approx((4 / 2 + 6 / 3) / 4)
    # Dr. GRPO: token sums over a constant horizon (default: the response width, 3), then the sequence mean.
    assert agg("seq-mean-token-sum-norm", global_seqs=4) == pytest.approx((4 + 6) / (4 * 3))
    assert agg("seq-mean-token-sum-norm", global_seqs=4, horizon=16) == pytest.approx((4 + 6) / (4 * 16))


def test_token_weights_hand_values() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], dtype=F64)
    assert count_sequences(mask).item() == 2.0  # a fully masked row is not a sequence of the mean
    w = compute_token_weights(mask, "seq-mean-token-mean")
    torch.testing.assert_close(w, torch.tensor([[1 / 2, 1 / 2, 0], [1 / 3, 1 / 3, 1 / 3], [0, 0, 0]], dtype=F64))
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        torch.testing.assert_close(compute_token_weights(mask, mode), mask)
    assert loss_divisor(LossScale("token-mean", global_tokens=20), 3) == 20
    assert loss_divisor(LossScale("seq-mean-token-mean", global_seqs=5), 3) == 5
    assert loss_divisor(LossScale("seq-mean-token-sum-norm", global_seqs=5), 3) == 15
    assert loss_divisor(LossScale("seq-mean-token-sum-norm", global_seqs=5, horizon=8), 3) == 40


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_split_rows_add_up_to_the_whole_mini_batch(mode: str) -> None:
    """Any row split with the global counts adds up to the whole; with its own rows' counts and
    verl's local normalisers, aggregate_loss is verl's agg_loss of those rows."""
    gen = torch.Generator().manual_seed(3)
    loss = torch.randn(5, 4, generator=gen, dtype=F64)
    mask = (torch.arange(4)[None, :] < torch.tensor([4, 1, 3, 0, 2])[:, None]).to(F64)
    scale = LossScale(mode, float(mask.sum()), float(count_sequences(mask)), horizon=6)
    whole = aggregate_loss(loss, mask, scale)
    parts = sum(aggregate_loss(loss[rows], mask[rows], scale) for rows in (slice(0, 2), slice(2, 3), slice(3, 5)))
    torch.testing.assert_close(parts, whole, rtol=0, atol=1e-12)
    sums, lens = (loss * mask).sum(-1), mask.sum(-1)
    verl = {"token-mean": sums.sum() / lens.sum(), "seq-mean-token-sum": sums.sum() / 4,
            "seq-mean-token-mean": (sums[lens > 0] / lens[lens > 0]).sum() / 4,
            "seq-mean-token-sum-norm": sums.sum() / (4 * 6)}[mode]
    torch.testing.assert_close(whole, verl, rtol=0, atol=1e-12)


def test_legal_modes_are_one_list() -> None:
    assert AGGREGATION_MODES == LOSS_AGG_MODES


def test_aggregation_errors() -> None:
    loss = torch.ones(2, 3)
    with pytest.raises(ValueError, match="global_token_count must be > 0"):
        aggregate_token_mean(loss, torch.ones(2, 3), 0)
    with pytest.raises(ValueError, match="global_token_count is required"):
        aggregate_loss(loss, torch.ones(2, 3), LossScale("token-mean"))
    with pytest.raises(ValueError, match="global_seq_count is required"):
        aggregate_loss(loss, torch.ones(2, 3), LossScale("seq-mean-token-mean", global_tokens=6))
    with pytest.raises(ValueError, match="legal modes: token-mean, seq-mean-token-sum"):
        aggregate_loss(loss, torch.ones(2, 3), LossScale("seq-sum", global_seqs=2))
    with pytest.raises(ValueError, match=r"horizon \(loss_scale_factor\) must be > 0"):
        aggregate_loss(loss, torch.ones(2, 3), LossScale("seq-mean-token-sum-norm", global_seqs=2, horizon=0))
    with pytest.raises(ValueError, match=r"\[B, R\] loss"):
        aggregate_loss(torch.ones(6), torch.ones(6), LossScale("seq-mean-token-sum", global_seqs=2))
    with pytest.raises(ValueError, match="mask shape"):
        masked_sum(loss, torch.ones(3, 2))


# --- gradient of the global token-mean does not depend on how the mini-batch is split ---------

B, R, D, V = 6, 5, 4, 7
LENGTHS = [5, 1, 3, 2, 4, 5]


def _problem() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    mask = (torch.arange(R)[None, :] < torch.tensor(LENGTHS)[:, None]).to(F64)
    return {
        "features": torch.randn(B, R, D, generator=gen, dtype=F64),
        "targets": torch.randint(0, V, (B, R), generator=gen),
        "weight": torch.randn(D, V, generator=gen, dtype=F64),
        "old_noise": 0.3 * torch.randn(B, R, generator=gen, dtype=F64),
        "advantages": torch.randn(B, R, generator=gen, dtype=F64),
        "mask": mask,
    }


def _micro_loss(p: dict[str, torch.Tensor], weight: torch.Tensor, rows: slice, count: float | None) -> torch.Tensor:
    """PPO loss of rows of a tiny linear policy; ``count=None`` means the naive local token-mean."""
    logits = p["features"][rows] @ weight
    logprobs = torch.log_softmax(logits, -1).gather(-1, p["targets"][rows, :, None]).squeeze(-1)
    old = logprobs.detach() + p["old_noise"][rows]  # ratios spread over and beyond the clip range
    mask = p["mask"][rows]
    loss_tokens, _ = compute_ppo_clip_loss(logprobs, old, p["advantages"][rows], mask)
    return aggregate_token_mean(loss_tokens, mask, mask.sum() if count is None else count)


def _accumulated_grad(p: dict[str, torch.Tensor], split: list[int], count: float | None) -> torch.Tensor:
    weight = p["weight"].clone().requires_grad_(True)
    start = 0
    for size in split:
        loss = _micro_loss(p, weight, slice(start, start + size), count)
        # The naive variant averages micro-batch means, as plain gradient accumulation would.
        (loss if count is not None else loss / len(split)).backward()
        start += size
    return weight.grad


@pytest.mark.parametrize("split", [[1, 2, 3], [3, 3], [2, 2, 2], [1] * B])
def test_token_mean_gradient_independent_of_micro_batch_split(split: list[int]) -> None:
    p = _problem()
    global_count = float(p["mask"].sum())
    full = _accumulated_grad(p, [B], global_count)
    split_grad = _accumulated_grad(p, split, global_count)
    # fp64, tests/tolerances.py: the features' matmul (D), the log-softmax (V) and the token sum over the
    # micro-batches (B x R) in another order, and their transposes backward (measured: <= 1/45 of it)
    rtol = roundoff_rtol(reduction=max(B * R, D, V), stages=6, dtype=F64)
    assert_grads_close({"weight": split_grad}, {"weight": full}, rtol)
    assert full.abs().max() > 1e-3  # the gradient is not trivially zero
    naive = _accumulated_grad(p, split, None)
    assert (naive - full).abs().max() > 1e-3  # per-micro-batch token-mean is NOT the same objective
