"""The step stage on data-parallel shards (rlsp.workers.step_stage) against the driver's one-process formulas.

Each rank of a gloo group takes its dp group's rows (a Ulysses pair shares them, as Dispatch.BY_DP sends
them) and runs `run_step_stage` with the reduction `ActorRole.compute_advantages` gives it (`dp_sum` over the
dp group). The shards, put back in row order, are compared with what the driver computed on the whole batch
before the stage existed (`apply_kl_penalty`, then `compute_advantages` on every row), every element:

- per-row results (token rewards, each row's KL, GAE's returns and REINFORCE++'s returns) bit for bit;
- whitened advantages within the rounding of the two batch-wide sums taken in another order
  (tests/tolerances.py, derivation 1), scaled by the whitened values' size;
- the whitening alone (rlsp.algos.whiten) over rows split unevenly across two processes likewise.

Rows have holes in their masks and one row has no response token.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _launch import layout_dims, run_distributed
from tolerances import assert_tensor_close, roundoff_rtol

from rlsp.algos.adv_inputs import AdvantageInputs
from rlsp.algos.kl_ctrl import apply_kl_penalty, batch_kl
from rlsp.algos.registry import compute_advantages
from rlsp.algos.whiten import masked_whiten
from rlsp.data.batch import Batch
from rlsp.rewards.scoring import place_scores
from rlsp.workers.step_stage import STAGE_READS, STAGE_WRITES, StageRequest, dp_sum, run_step_stage

pytestmark = pytest.mark.distributed

B, R = 8, 13
REQUESTS = {
    "gae+kl": StageRequest("gae", {"gamma": 0.99, "lam": 0.95}, kl_coef=0.05, kl_kind="low_var_kl"),
    "reinforce_pp": StageRequest("reinforce_plus_plus", {"gamma": 0.9}),
    "kl only": StageRequest(None, kl_coef=0.1, kl_kind="kl"),
}


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    mask = (torch.rand(B, R, generator=gen) > 0.2).float()
    mask[:, 0] = 1
    mask[:, R - 3:] = 0
    mask[3] = 0  # no response token
    return {"response_mask": mask, "row_reward": torch.randn(B, generator=gen),
            "old_logprobs": -torch.rand(B, R, generator=gen) * 3, "ref_logprobs": -torch.rand(B, R, generator=gen) * 3,
            "values": torch.randn(B, R, generator=gen) * mask, "step_rewards": torch.randn(B, R, generator=gen) * 0.1}


def _rows(cols: dict[str, torch.Tensor], rows: slice, scores_by_value: bool) -> Batch:
    """The rows a dp shard receives: the declared reads only; scores as the driver's column or as row values."""
    keys = [k for k in STAGE_READS if k in cols and (k != "row_reward" or not scores_by_value)]
    out = {k: cols[k][rows] for k in keys}
    if scores_by_value:
        out["token_level_scores"] = _scores(cols)[rows]
    return Batch.from_dict(out)


def _scores(cols: dict[str, torch.Tensor]) -> torch.Tensor:
    return place_scores(cols["row_reward"].tolist(), cols["response_mask"]) + cols["step_rewards"] * cols["response_mask"]


def _stage_worker(rank: int, world: int, ulysses: int) -> dict[str, dict[str, torch.Tensor]]:
    dims = layout_dims(ulysses=ulysses)
    cols, per = _batch(), B // dims.dp_size
    rows = slice(dims.dp_rank * per, (dims.dp_rank + 1) * per)
    reduce = dp_sum(dims.dp_group) if dims.dp_size > 1 else None  # what ActorRole.compute_advantages passes
    out = {}
    for name, request in REQUESTS.items():
        result = run_step_stage(_rows(cols, rows, scores_by_value=name == "reinforce_pp"), request, reduce)
        assert set(result.keys()) <= set(STAGE_WRITES), sorted(result.keys())
        out[name] = {k: result[k] for k in result.keys()}
    return out


def _reference(name: str) -> dict[str, torch.Tensor]:
    """What the driver computed on the whole batch."""
    cols, request = _batch(), REQUESTS[name]
    mask = cols["response_mask"]
    scores = _scores(cols) if name == "reinforce_pp" else place_scores(cols["row_reward"].tolist(), mask)
    ref: dict[str, torch.Tensor] = {"token_level_rewards": scores}
    if request.kl_coef is not None:
        ref["token_level_rewards"], ref["current_kl"] = apply_kl_penalty(
            scores, cols["old_logprobs"], cols["ref_logprobs"], mask, request.kl_coef, request.kl_kind)
    if request.estimator is not None:
        values = {"values_BR": cols["values"]} if request.estimator == "gae" else {}
        inputs = AdvantageInputs(ref["token_level_rewards"], mask, [str(i // 4) for i in range(B)], **request.settings,
                                 **values)
        ref["advantages"], ref["returns"] = compute_advantages(request.estimator, inputs)
    return ref


def _check(results: list[dict[str, dict[str, torch.Tensor]]], ulysses: int) -> None:
    answering = results[::ulysses]  # the dp groups' first ranks, in row order
    for rank, res in enumerate(results):  # a dp group's ranks computed the same shard
        assert all(torch.equal(res[n][k], answering[rank // ulysses][n][k]) for n in res for k in res[n])
    mask = _batch()["response_mask"]
    for name in REQUESTS:
        got = {k: torch.cat([r[name][k] for r in answering]) for k in answering[0][name]}
        ref = _reference(name)
        assert torch.equal(got["token_level_rewards"], ref["token_level_rewards"]), name
        if "current_kl" in ref:
            assert batch_kl(got["reward_kl"]) == ref["current_kl"], name  # the adaptive controller's input
        if "advantages" not in ref:
            assert "advantages" not in got
            continue
        assert torch.equal(got["returns"], ref["returns"]), name  # per row: any split gives the same
        raw = ref["returns"] - (_batch()["values"] if name == "gae+kl" else 0)  # what was whitened
        std = float(raw[mask.bool()].std())
        rtol = roundoff_rtol(reduction=int(mask.sum()), stages=2)  # the mean's sum, the variance's sum
        assert_tensor_close(got["advantages"], ref["advantages"], rtol,
                            value_scale=float(raw[mask.bool()].abs().max()) / std + float(ref["advantages"].abs().max()))
        assert torch.equal(got["advantages"] == 0, mask == 0)
        sums = (ref["advantages"] * mask).sum(-1)
        assert_tensor_close(got["advantages_sum"], sums, rtol * R, value_scale=float(ref["advantages"].abs().max()))


@pytest.mark.parametrize("ulysses", [1, 2], ids=["dp2", "dp2-ulysses2"])
def test_step_stage_on_dp_shards_equals_the_driver_formulas(ulysses):
    _check(run_distributed(_stage_worker, 2 * ulysses, ulysses), ulysses)


def _whiten_worker(rank: int, world: int, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    rows = slice(0, 3) if rank == 0 else slice(3, None)  # uneven: whitening needs no equal shards
    return masked_whiten(values[rows], mask[rows], eps=1e-6, reduce=dp_sum(dist.group.WORLD))


def test_whitening_over_rows_split_across_two_processes():
    gen = torch.Generator().manual_seed(1)
    values, mask = torch.randn(8, 21, generator=gen) * 2 + 5, (torch.rand(8, 21, generator=gen) > 0.3).float()
    got = torch.cat(run_distributed(_whiten_worker, 2, values, mask))
    ref = masked_whiten(values, mask, eps=1e-6)
    std = float(values[mask.bool()].std())
    assert_tensor_close(got, ref, roundoff_rtol(reduction=int(mask.sum()), stages=2),
                        value_scale=float(values.abs().max()) / std + float(ref.abs().max()))
    assert torch.equal(got == 0, mask == 0)
