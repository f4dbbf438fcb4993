"""Whitening with an optional reduction (rlsp.algos.whiten): without one it is the one-process whitening bit
for bit, and only the estimators that declare it accept rows that are a shard of the batch. The same
whitening over rows split across two gloo processes: tests/distributed/test_step_stage.py."""

from __future__ import annotations

import pytest
import torch

from rlsp.algos.adv_inputs import AdvantageInputs
from rlsp.algos.aggregation import masked_whiten as one_process_whiten
from rlsp.algos.registry import compute_advantages, users_of
from rlsp.algos.whiten import masked_moments, masked_whiten


def _rows(seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(6, 9, generator=gen, dtype=dtype) * 3 + 1
    mask = (torch.rand(6, 9, generator=gen) > 0.3).float()
    mask[2] = 0  # a row without response tokens
    values[mask == 0] = float("nan")  # padding never leaks
    return values, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_without_a_reduction_it_is_the_one_process_whitening_bit_for_bit(dtype):
    for seed in range(5):
        values, mask = _rows(seed, dtype)
        got = masked_whiten(values, mask, eps=1e-6)
        assert torch.equal(got, one_process_whiten(values, mask, eps=1e-6))
        assert torch.isfinite(got).all() and (got[mask == 0] == 0).all()


def test_a_reduction_that_sums_two_copies_gives_the_statistics_of_both():
    # Two identical shards: every sum doubles, the mean stays and the unbiased variance becomes (2n-2)/(2n-1)
    # of the two-copy batch's, which is what the concatenated batch gives.
    values, mask = _rows(7, torch.float64)
    mean, var = masked_moments(values, mask, reduce=lambda x: 2 * x)
    ref_mean, ref_var = masked_moments(torch.cat([values, values]), torch.cat([mask, mask]))
    assert torch.allclose(mean, ref_mean, rtol=1e-14) and torch.allclose(var, ref_var, rtol=1e-14)


def test_estimators_without_batch_wide_sums_refuse_a_reduction():
    # grpo's statistics are per group (a shard holding whole groups needs no reduction); a reduction given to
    # it is refused, naming the estimators with batch-wide sums that take one.
    values, mask = _rows(3)
    inputs = AdvantageInputs(torch.nan_to_num(values), mask, index=["a", "a", "b", "b", "c", "c"], reduce=lambda x: x)
    with pytest.raises(ValueError, match=r"'grpo' does not use reduce.*\['gae', 'gdpo', 'gpg', 'reinforce_plus_plus', "
                                         r"'reinforce_plus_plus_baseline'\]"):
        compute_advantages("grpo", inputs)
    assert users_of("reduce") == ["gae", "gdpo", "gpg", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
