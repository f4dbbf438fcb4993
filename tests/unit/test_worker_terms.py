"""What the driver sends and keeps for the terms the policy workers compute between the passes.

- gdpo: the driver turns the reward function's per-row dicts into one float per row and component
  (`set_stage_components`); the step stage on those rows gives the driver's own gdpo advantages bit for bit
  (the whole batch on one process here; dp shards: tests/distributed/test_stage_estimators.py);
- distillation: `Distillation.add_term` runs `TeacherRole.apply_distillation` over two dp shards in this process
  as the workers run it (the declared columns of each shard built from blocks, `assemble`; the declared writes kept
  as blocks, the declared reports returned: rlsp.workers.worker.Worker.execute_rows). Its metrics equal the
  whole-batch `distillation_metrics` bit for bit, the reported bytes per row are the same at two response
  lengths, and its advantages, a worker column, replace the outcome estimators' row broadcast the driver held:
  the next call is sent the worker's column, not the broadcast.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict

from rlsp.algos.distillation import compute_distillation_advantages, compute_distillation_losses, distillation_metrics
from rlsp.algos.registry import compute_advantages
from rlsp.config.schema import RLSPConfig
from rlsp.controller.step_data import Block, StepData, from_results, new_row_ids
from rlsp.data.batch import Batch
from rlsp.rewards.scoring import place_scores
from rlsp.step.distill import Distillation
from rlsp.step.estimator_inputs import advantage_inputs, config_settings, set_stage_components
from rlsp.workers.columns import assemble, row_report
from rlsp.workers.dispatch import declared_fields
from rlsp.workers.roles.teacher import TeacherRole
from rlsp.workers.step_stage import COMPONENTS_KEY, STAGE_READS, StageRequest, run_step_stage

B, R = 8, 5


def _gdpo_cfg():
    cfg = OmegaConf.structured(RLSPConfig)
    cfg.algorithm.adv_estimator, cfg.algorithm.gdpo_reward_keys = "gdpo", ["fmt", "acc"]
    cfg.algorithm.gdpo_reward_weights = [0.5, 1.0]
    return cfg


def _scored_rows() -> Batch:
    gen = torch.Generator().manual_seed(3)
    mask = (torch.rand(B, R, generator=gen) > 0.3).float()
    mask[:, 0], mask[6] = 1, 0  # a row without response tokens
    acc, fmt = torch.randint(0, 2, (B,), generator=gen).tolist(), torch.rand(B, generator=gen).tolist()
    extras = [{"score": a + f, "acc": a, "fmt": f, "note": "x"} for a, f in zip(acc, fmt)]
    scores = [e["score"] for e in extras]
    return Batch.from_dict({"response_mask": mask, "row_reward": torch.tensor(scores, dtype=torch.float32),
                            "token_level_scores": place_scores(scores, mask)},
                           meta={"uid": [f"p{i % 3}" for i in range(B)], "data_source": ["src"] * B,
                                 "reward_extra_info": extras})


def test_gdpo_on_the_stage_from_per_row_components_equals_the_driver() -> None:
    cfg, rows = _gdpo_cfg(), _scored_rows()
    driver = rows.copy()
    driver.set("token_level_rewards", driver["token_level_scores"])
    adv, ret = compute_advantages("gdpo", advantage_inputs(driver, cfg))  # gdpo on the driver, from the per-row dicts

    names = set_stage_components(rows, cfg)
    assert names == ("fmt", "acc") and rows[COMPONENTS_KEY].dtype == torch.float64
    assert rows[COMPONENTS_KEY].shape == (B, 2)  # one float per row and component, whatever the response length
    assert rows[COMPONENTS_KEY][:, 1].tolist() == [e["acc"] for e in rows.meta["reward_extra_info"]]
    sent = Batch.from_dict({k: rows[k] for k in STAGE_READS if k in rows.tensors.keys() and k != "token_level_scores"},
                           meta={"uid": rows.meta["uid"]})  # the scores as the per-row rewards, as the driver sends them
    out = run_step_stage(sent, StageRequest("gdpo", config_settings(cfg), components=names), None)
    assert torch.equal(out["advantages"], adv) and torch.equal(out["returns"], ret)
    assert torch.count_nonzero(out["advantages"]) > 0

    other = OmegaConf.structured(RLSPConfig)  # grpo reads no components: nothing is sent
    assert set_stage_components(rows.copy(), other) == ()
    with pytest.raises(ValueError, match=r"has shape \(8, 2\) for the components \['acc'\]"):
        run_step_stage(sent, StageRequest("gdpo", config_settings(cfg), components=("acc",)), None)


class Held:
    """A block as a worker holds it: the driver has a handle (compared by identity, as Ray's references are)."""

    def __init__(self, batch: Batch) -> None:
        self.batch = batch


class LocalTeachers:
    """`TeacherRole.apply_distillation` over `dp` shards of the rows, in this process, as Worker.execute_rows runs it."""

    def __init__(self, dp: int) -> None:
        self.dp, self.report_bytes = dp, 0
        self.role = object.__new__(TeacherRole)  # the method runs no model: a role without teachers loaded

    def call(self, role: str, method: str, data: StepData, *args) -> StepData:
        assert (role, method) == ("teacher", "apply_distillation")
        fields, size = declared_fields(TeacherRole, method), len(data) // self.dp
        groups = [range(g * size, (g + 1) * size) for g in range(self.dp)]
        stays, reports = [], []
        for rows in groups:
            spec, refs = data.spec(rows, fields.reads)
            shard = assemble(spec, [ref.batch for ref in refs])
            result = self.role.apply_distillation(shard, *args)
            assert set(shard.keys()) <= fields.reads and set(result.keys()) <= fields.writes
            report = row_report(shard.copy().update(result), fields.reports)
            assert set(report.keys()) == set(fields.reports)
            self.report_bytes += sum(t.numel() * t.element_size() for t in report.tensors.values())
            stays.append(Held(result))
            reports.append(report)
        keys = sorted(stays[0].batch.keys())
        return from_results(data, groups, stays, reports, keys, keys)


def _distill_step(R: int) -> tuple[StepData, dict[str, torch.Tensor]]:
    """A step whose samples, old logprobs and teacher logprobs are worker blocks (two each) and whose outcome
    advantages the driver holds as one value per row."""
    gen = torch.Generator().manual_seed(R)
    mask = (torch.rand(B, R, generator=gen) > 0.3).float()
    mask[:, 0], mask[6] = 1, 0
    cols = {"response_mask": mask, "old_logprobs": -torch.rand(B, R, generator=gen) * 3,
            "teacher_logprobs": -torch.rand(B, R, generator=gen) * 12, "row_advantage": torch.randn(B, generator=gen)}
    ids = new_row_ids(B)
    data = StepData(ids, Batch(TensorDict({}, batch_size=[B]), {}, {}))
    for key in ("response_mask", "old_logprobs", "teacher_logprobs"):
        for rows in (range(0, 4), range(4, B)):
            held = Held(Batch.from_dict({key: cols[key][list(rows)]}))
            data.blocks.append(Block(held, frozenset({key}), tuple(ids[i] for i in rows)))
        data._tensor_keys.add(key)
    data.set_row("advantages", cols["row_advantage"])
    return data, cols


def test_the_distillation_term_runs_on_the_workers_and_the_driver_gets_per_row_values() -> None:
    cfg = OmegaConf.structured(RLSPConfig)
    cfg.distillation.distillation_loss.distillation_loss_coef = 0.5
    distill = Distillation(cfg, [])  # the term's settings: loss_mode k3 and the default clamps
    sizes = []
    for R in (6, 48):
        data, cols = _distill_step(R)
        teachers = LocalTeachers(dp=2)
        metrics = distill.add_term(teachers, data)
        sizes.append(teachers.report_bytes / B)
        mask = cols["response_mask"]
        loss = cfg.distillation.distillation_loss
        d = compute_distillation_losses(cols["old_logprobs"], cols["teacher_logprobs"], mask, loss_mode=loss.loss_mode,
                                        loss_max_clamp=loss.loss_max_clamp, log_prob_min_clamp=loss.log_prob_min_clamp)
        assert metrics == distillation_metrics(cols["old_logprobs"], cols["teacher_logprobs"], d, mask)
        want = compute_distillation_advantages(cols["row_advantage"][:, None] * mask, d, mask, coef=0.5)
        assert data.row_value("advantages") is None and data.unread(["advantages"]) == ["advantages"]  # on the workers
        spec, refs = data.spec(range(2, 7), ("advantages", "response_mask"))
        assert torch.equal(assemble(spec, [ref.batch for ref in refs])["advantages"], want[2:7])  # the worker's column
        assert torch.equal(data["advantages_sum"], (want * mask).sum(-1))  # the driver's advantages/mean reads it
    assert sizes[0] == sizes[1] and sizes[0] <= 8 * 8  # 8 float64 per row whatever the response length
