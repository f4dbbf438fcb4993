"""The step stage when a step's prompt groups cannot be cut into equal dp chunks: shards of unequal row counts,
whole groups each (rlsp.step.stage_advantages.group_shards), one of them empty when there are fewer groups than dp
groups, against the stage on the whole batch in one process, every element.

Each gloo rank plays the driver and one policy worker. As the driver it runs `compute_token_rewards` (the shard plan,
the request, the KL controller and its metrics) on a step whose columns are worker blocks and whose uid and reward
dicts the driver holds. The worker group (`GlooWorkers`) runs the call as RayWorkerGroup and Worker.execute_rows do:
the row ranges of the call's `shards` (`dp_row_ranges`), the dp group's declared columns built from the blocks
(`StepData.spec`, `assemble`; an empty shard gets every column with no rows), the stage with the reduction
`ActorRole.compute_advantages` gives it (`dp_sum` over the dp group), the declared per-row reports (`row_report`),
and every dp group's block and report gathered into the step (`from_results`; all_gather_object stands for Ray's
transport). A Ulysses pair shares its dp group's shard.

- GRPO and GPG (whose batch-wide statistic is two integer counts) bit for bit;
- the whitening estimators (REINFORCE++ with its group baseline, GDPO with its reward components) bit for bit when
  one dp group holds every row (the other adds zeros), else within the rounding of the whitening's two sums taken
  in another order (tests/tolerances.py, derivation 1), scaled by the whitened values' size.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _launch import layout_dims, run_distributed
from omegaconf import OmegaConf
from tensordict import TensorDict
from tolerances import assert_tensor_close, roundoff_rtol

from rlsp.algos.aggregation import group_mean_std
from rlsp.algos.kl_ctrl import batch_kl, build_kl_controller
from rlsp.config.layout import ParallelLayout, RoleLayout, World
from rlsp.config.schema import RLSPConfig
from rlsp.controller.step_data import Block, StepData, from_results, new_row_ids
from rlsp.controller.worker_group import dp_row_ranges
from rlsp.data.batch import Batch
from rlsp.step.estimator_inputs import config_settings, set_stage_components
from rlsp.step.stage_advantages import compute_token_rewards
from rlsp.workers.columns import assemble, row_report
from rlsp.workers.dispatch import declared_fields
from rlsp.workers.roles.actor import ActorRole
from rlsp.workers.step_stage import STAGE_READS, STAGE_REPORTS, StageRequest, dp_sum, run_step_stage

pytestmark = pytest.mark.distributed

R, KL_COEF = 7, 0.05
ESTIMATORS = ("grpo", "gpg", "reinforce_plus_plus_baseline", "gdpo")
WHITENING = ("reinforce_plus_plus_baseline", "gdpo")
COMPONENTS = ("acc", "fmt")
CASES = {  # name: (the rows' groups, interleaved as after balancing; Ulysses degree)
    "3 groups of 4": ([f"p{i % 3}" for i in range(12)], 1),
    "1 group of 4": (["p0"] * 4, 1),
    "1 group of 4, ulysses 2": (["p0"] * 4, 2),
}
WORKER_COLUMNS = ("response_mask", "old_logprobs", "ref_logprobs")


class Held:
    """A block as a worker holds it (the driver keeps a handle, compared by identity as Ray's references are)."""

    def __init__(self, batch: Batch) -> None:
        self.batch = batch


def _cfg(name: str):
    cfg = OmegaConf.structured(RLSPConfig)
    cfg.algorithm.adv_estimator, cfg.algorithm.use_kl_in_reward = name, True
    cfg.algorithm.kl_penalty, cfg.algorithm.kl_ctrl.kl_coef = "low_var_kl", KL_COEF
    if name == "gdpo":
        cfg.algorithm.gdpo_reward_keys, cfg.algorithm.gdpo_reward_weights = list(COMPONENTS), [1.0, 0.5]
    return cfg


def _columns(uids: list[str]) -> dict:
    """The step's values: masks with holes and a row without response tokens, scores with ties within groups."""
    n, gen = len(uids), torch.Generator().manual_seed(len(uids))
    mask = (torch.rand(n, R, generator=gen) > 0.25).float()
    mask[:, 0], mask[:, R - 1], mask[1] = 1, 0, 0
    acc = torch.randint(0, 2, (n,), generator=gen).tolist()
    fmt = torch.rand(n, generator=gen).tolist()
    return {"response_mask": mask, "old_logprobs": -torch.rand(n, R, generator=gen) * 3,
            "ref_logprobs": -torch.rand(n, R, generator=gen) * 3, "row_reward": torch.tensor([a + f for a, f in zip(acc, fmt)]),
            "extras": [{"score": a + f, "acc": a, "fmt": f} for a, f in zip(acc, fmt)]}


def _step(uids: list[str]) -> StepData:
    """The step as the driver holds it after the passes: the rows' columns in two worker blocks (the rollout's equal
    halves), each row's reward, uid and reward dict held here."""
    cols, n = _columns(uids), len(uids)
    table = Batch(TensorDict({"row_reward": cols["row_reward"]}, batch_size=[n]),
                  {"uid": list(uids), "data_source": ["src"] * n, "reward_extra_info": cols["extras"]}, {})
    data = StepData(new_row_ids(n), table, tensor_keys=WORKER_COLUMNS)
    for rows in (range(0, n // 2), range(n // 2, n)):
        held = Held(Batch.from_dict({k: cols[k][list(rows)] for k in WORKER_COLUMNS}))
        data.blocks.append(Block(held, frozenset(WORKER_COLUMNS), tuple(data.ids[i] for i in rows)))
    return data


class GlooWorkers:
    """`RayWorkerGroup.call("actor", "compute_advantages", ...)` over this gloo world (see the module docstring)."""

    def __init__(self, ulysses: int) -> None:
        world = World(1, dist.get_world_size())
        actor = RoleLayout(world, ulysses=ulysses)
        self.layout = ParallelLayout(policy=world, actor=actor, ref=actor)
        self.world_size, self.dims = world.world_size, layout_dims(ulysses)
        self.shard_rows: list[int] = []  # the rows each call gave this rank

    def call(self, role: str, method: str, data: StepData, request: StageRequest, shards=None) -> StepData:
        assert (role, method) == ("actor", "compute_advantages")
        fields, per_dp = declared_fields(ActorRole, method), self.layout.role(role).ranks_per_dp
        groups = dp_row_ranges(len(data), self.world_size // per_dp, shards)
        spec, refs = data.spec(groups[self.dims.dp_rank], fields.reads)
        rows = assemble(spec, [ref.batch for ref in refs])
        assert set(rows.keys()) <= fields.reads
        self.shard_rows.append(len(rows))
        reduce = dp_sum(self.dims.dp_group) if self.dims.dp_size > 1 else None  # ActorRole.compute_advantages's
        result = run_step_stage(rows, request, reduce)
        report = row_report(rows.copy().update(result), fields.reports)
        shapes = {k: (rows[k].dtype, rows[k].shape[1:]) for k in rows.tensors.keys()}
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, (result, report, shapes))
        assert all(g[2] == shapes for g in gathered), "an empty shard's columns keep their dtypes and shapes"
        firsts = gathered[::per_dp]  # each dp group's answering rank
        keys = sorted(result.tensors.keys())
        return from_results(data, groups, [Held(r) for r, _, _ in firsts], [rep for _, rep, _ in firsts], keys, keys)


def _stage_rank(rank: int, world: int, uids: list[str], ulysses: int) -> dict:
    workers, out = GlooWorkers(ulysses), {}
    for name in ESTIMATORS:
        data, cfg = _step(uids), _cfg(name)
        metrics = compute_token_rewards(workers, data, cfg, build_kl_controller("fixed", KL_COEF))
        spec, refs = data.spec(range(len(data)), ("token_level_rewards", "advantages", "returns"))
        columns = assemble(spec, [ref.batch for ref in refs])  # what the updates read, worker to worker
        reported = {k: data[k] for k in STAGE_REPORTS if k in data.table.tensors.keys()}  # the driver's per-row values
        out[name] = {"metrics": metrics, **{k: columns[k] for k in columns.keys()}, **reported}
    out["shard_rows"] = workers.shard_rows
    return out


def _reference(name: str, uids: list[str]) -> dict[str, torch.Tensor]:
    """The stage on the whole batch in one process, as the driver would send it (no reduction)."""
    data, cfg = _step(uids), _cfg(name)
    components = set_stage_components(data, cfg)
    spec, refs = data.spec(range(len(data)), STAGE_READS)
    rows = assemble(spec, [ref.batch for ref in refs])
    result = run_step_stage(rows, StageRequest(name, config_settings(cfg), KL_COEF, "low_var_kl", False, components), None)
    return {k: result[k] for k in result.keys()}


def _whitened(name: str, uids: list[str], ref: dict[str, torch.Tensor]) -> torch.Tensor:
    """What the estimator whitens: REINFORCE++-baseline's returns; GDPO's weighted sum of the components, each
    normalised within its group, on every response token."""
    if name != "gdpo":
        return ref["returns"]
    cols = _columns(uids)
    total = torch.zeros(len(uids), dtype=torch.float64)
    for key, weight in zip(COMPONENTS, (1.0, 0.5)):
        values = torch.tensor([e[key] for e in cols["extras"]], dtype=torch.float64)
        mean, std, _ = group_mean_std(values, uids)
        total += weight * (values - mean) / (std + 1e-6)
    return total.unsqueeze(-1) * cols["response_mask"]


def _check(name: str, got: dict, ref: dict, uids: list[str], exact: bool) -> None:
    mask = _columns(uids)["response_mask"]
    assert got["metrics"] == {"actor/reward_kl_penalty": batch_kl(ref["reward_kl"]),
                              "actor/reward_kl_penalty_coeff": KL_COEF}, name
    for key in ("token_level_rewards", "reward_kl", "score_sum", "reward_sum"):
        assert torch.equal(got[key], ref[key]), (name, key)
    assert set(got) - {"metrics"} == set(ref), name  # every column and report of the whole-batch stage
    if exact or name not in WHITENING:
        for key in ref:
            assert torch.equal(got[key], ref[key]), (name, key)
        return
    raw = _whitened(name, uids, ref)
    std = float(raw[mask.bool()].std())
    rtol = roundoff_rtol(reduction=int(mask.sum()), stages=2)  # the mean's sum, the variance's sum
    scale = float(raw[mask.bool()].abs().max()) / std + float(ref["advantages"].abs().max())
    assert_tensor_close(got["advantages"], ref["advantages"], rtol, value_scale=scale)
    assert torch.equal(got["advantages"] == 0, (mask == 0) | (ref["advantages"] == 0)), name
    row_scale = scale * float(mask.sum(-1).max())  # a row's sum: at most a row's tokens of such errors (x^2: 2|x| each)
    for key in ("advantages_sum", "returns_sum", "returns_sq_sum"):
        if name == "gdpo" or key == "advantages_sum":  # gdpo's returns are its advantages
            assert_tensor_close(got[key], ref[key], rtol, value_scale=row_scale * (2 * scale if "sq" in key else 1.0))
        else:
            assert torch.equal(got[key], ref[key]), (name, key)


@pytest.mark.parametrize("case", list(CASES))
def test_uneven_group_shards_equal_the_whole_batch(case: str) -> None:
    uids, ulysses = CASES[case]
    results = run_distributed(_stage_rank, 2 * ulysses, uids, ulysses)
    sizes = [4, 0] if len(set(uids)) == 1 else [8, 4]  # whole groups, as even as they allow
    assert [r["shard_rows"] for r in results] == [[s] * len(ESTIMATORS) for s in sizes for _ in range(ulysses)]
    for name in ESTIMATORS:
        ref = _reference(name, uids)
        assert torch.count_nonzero(ref["advantages"]) > 0, name
        for got in results:  # every rank, as the driver, holds the same step
            _check(name, got[name], ref, uids, exact=len(set(uids)) == 1)
