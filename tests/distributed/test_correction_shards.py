"""The rollout correction on two data-parallel ranks (rlsp.workers.stage_correction) against the whole-batch
computation the driver ran before it moved there (rlsp.algos.rollout_correction.compute_rollout_correction),
every element and every metric.

Each rank runs `run_correction` on its half of the rows with the reduction `ActorRole.compute_rollout_correction`
gives it (`dp_sum` over the dp group); the halves' columns, put together, are compared with the whole batch's:

- the rejection masks bit for bit (every decision is per token or per row);
- the weights bit for bit without batch normalisation; with it within the rounding of the normalisation's one
  batch-wide fp64 sum taken in another order (tests/tolerances.py, derivation 1) and the division's own rounding;
- every rollout_corr/* metric the driver builds from the ranks' per-row reports equal to the whole batch's: the
  per-row values are the same on a shard as on the whole batch, bit for bit.

The rows have holes in their masks and one row has no response token; the log-ratios are wide enough that the
weights are truncated, the normalisation factor is not 1 and rejection drops tokens and rows.
"""

from __future__ import annotations

import pytest
import torch
from _launch import layout_dims, run_distributed
from tolerances import assert_tensor_close, roundoff_rtol, unit_roundoff

from rlsp.algos.rollout_correction import ROW_STATS, RolloutCorrection, compute_rollout_correction, correction_metrics
from rlsp.data.batch import Batch
from rlsp.workers.stage_correction import ACTOR_MASK, CORRECTION_READS, reported_stats, run_correction
from rlsp.workers.step_stage import dp_sum

pytestmark = pytest.mark.distributed

B, R = 12, 10
CASES = {
    "token-normalised-k1-seqmax": RolloutCorrection("token", 1.5, True, "token_k1,seq_max_k2", "0.6_1.6,0.5"),
    "sequence-normalised-seqmean": RolloutCorrection("sequence", 2.0, True, "seq_mean_k3", 0.08),
    "token-plain": RolloutCorrection("token", 2.0, False, None, None),
    "rejection-only": RolloutCorrection(None, 2.0, False, "seq_sum_k1", "0.4_2.5"),
}


def _batch() -> Batch:
    gen = torch.Generator().manual_seed(11)
    mask = (torch.rand(B, R, generator=gen) > 0.25).float()
    mask[:, 0] = 1
    mask[5] = 0  # a row without response tokens
    old = -torch.rand(B, R, generator=gen) * 3
    rollout = old + torch.randn(B, R, generator=gen) * 0.5 + torch.randn(B, 1, generator=gen) * 0.1
    rollout[mask == 0] = 7.0  # padding garbage must never leak
    return Batch.from_dict({"old_logprobs": old, "rollout_logprobs": rollout, "response_mask": mask})


def _worker(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    dims = layout_dims()
    per = B // dims.dp_size
    rows = _batch().select_rows(list(range(dims.dp_rank * per, (dims.dp_rank + 1) * per)))
    reduce = dp_sum(dims.dp_group)  # what ActorRole.compute_rollout_correction passes
    out = {}
    for name, settings in CASES.items():
        result = run_correction(rows, settings, reduce)
        out[name] = {k: result[k] for k in result.keys()}
    return out


def test_correction_on_dp_shards_equals_the_whole_batch():
    assert set(CORRECTION_READS) == set(_batch().keys())
    results = run_distributed(_worker, 2)
    full = _batch()
    mask = full["response_mask"]
    for name, settings in CASES.items():
        got = {k: torch.cat([r[name][k] for r in results]) for k in results[0][name]}
        weights, new_mask, metrics = compute_rollout_correction(full["old_logprobs"], full["rollout_logprobs"], mask,
                                                                settings)
        if settings.rollout_rs is not None:
            assert torch.equal(got[ACTOR_MASK], new_mask), name
            assert 0 < metrics["rollout_corr/rollout_rs_masked_fraction"] < 1, name  # rejection rejects
            assert float(new_mask.sum()) < float(mask.sum()), name
        else:
            assert ACTOR_MASK not in got, name
        if weights is None:
            assert "rollout_is_weights" not in got, name
        elif settings.rollout_is_batch_normalize:
            factor = metrics["rollout_corr/rollout_is_batch_norm_factor"]
            assert abs(factor - 1.0) > 1e-3, name
            # the factor's fp64 sum over rows (or tokens) in another order, then one fp32 division
            rtol = roundoff_rtol(reduction=int(mask.sum()), stages=1, dtype=torch.float64) + unit_roundoff()
            assert_tensor_close(got["rollout_is_weights"], weights, rtol)
            assert torch.equal(got["rollout_is_weights"] == 0, weights == 0), name
        else:
            assert torch.equal(got["rollout_is_weights"], weights), name
            assert float(metrics["rollout_corr/rollout_is_ratio_fraction_high"]) > 0, name  # truncation happens
        stats = reported_stats(Batch.from_dict({k: v for k, v in got.items() if k.startswith("rollout_corr_")}))
        assert set(stats) <= set(ROW_STATS) and "tokens" in stats, name
        assert correction_metrics(stats, settings) == metrics, name  # every metric, every digit
