"""The distillation teachers' logprobs (TeacherRole) equal a single-process forward of each teacher, and the
advantages are computed from them.

Reference: each teacher as a plain transformers causal LM in fp64 (eager attention), one unpadded row at a
time, log_softmax(logits / T) of the sampled next token. rlsp: TeacherRole as the workers build it (two
tiny teachers of different weights, FSDP2 fp32, rows routed by data_source) at one rank, at dp 2 and at
Ulysses 2 (each sequence split over two ranks). Every response logprob within the bound tests/tolerances.py
derives for the model (`_logprob_tol`); the Ulysses 2 result equals one rank's within it; padding stays 0.
The advantages the workers compute from them (`TeacherRole.apply_distillation` on each dp shard, distillation
alone: -(s - q), k1, and with the task advantage: A - coef * d) equal the formula on the fp64 logprobs within
that bound plus the formula's own fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _launch import run_distributed
from omegaconf import OmegaConf
from test_fsdp_engine import B, P, R, _rollout_batch, tolerances
from tolerances import roundoff_rtol, scalar_tol
from transformers import AutoConfig, AutoModelForCausalLM

from rlsp.config.schema import RLSPConfig
from rlsp.config.validate import validate_config
from rlsp.data.batch import Batch
from rlsp.models.tiny import TinyModelSpec, build_tiny_model
from rlsp.workers.context import RoleContext
from rlsp.workers.roles.teacher import TeacherRole
from rlsp.workers.stage_distill import DISTILL_READS, DistillRequest

pytestmark = pytest.mark.distributed
TEMPERATURE = 0.8
SOURCES = ["math", "geo"] * (B // 2)  # alternate rows: both teachers on every dp shard


def _config(paths: dict[str, str], world: int, ulysses: int):
    cfg = OmegaConf.structured(RLSPConfig)
    for key, val in {"trainer.n_gpus_per_node": world, "data.max_prompt_length": P, "data.max_response_length": R,
                     "actor_rollout_ref.actor.ulysses_sequence_parallel_size": ulysses,
                     "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 3,
                     "distillation.enabled": True}.items():
        OmegaConf.update(cfg, key, val)
    cfg.distillation.teacher_models = {name: {"key": name, "model_path": path} for name, path in paths.items()}
    return cfg


def _teacher_logprobs(rank: int, world: int, paths: dict[str, str], batch: Batch, ulysses: int):
    cfg = _config(paths, world, ulysses)
    layout = validate_config(cfg)
    role = TeacherRole(RoleContext(cfg, rank, layout, torch.device("cpu"), pad_token_id=0))
    dims = role.engines["math"].dims
    shard = batch.chunk(dims.dp_size)[dims.dp_rank]
    out = role.compute_teacher_log_prob(shard, ["math", "geo"])["teacher_logprobs"]
    assert dist.get_world_size() == world
    return out, dims.dp_rank, dims.coords.ulysses


def _reference(path: str, batch: Batch) -> torch.Tensor:
    """[B, R] fp64 logprobs of each row's response tokens under the teacher at `path` (0 on padding)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager")
    out = torch.zeros(len(batch), R, dtype=torch.float64)
    with torch.no_grad():
        for b in range(len(batch)):
            keep = batch["attention_mask"][b].bool()
            ids = batch["input_ids"][b][keep]
            start = int(keep[:P].sum())  # response tokens follow the unpadded prompt
            logp = torch.log_softmax(model(ids[None]).logits[0] / TEMPERATURE, dim=-1)
            n = len(ids) - start
            out[b, :n] = logp[start - 1:len(ids) - 1].gather(-1, ids[start:, None])[:, 0]
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    paths = {name: build_tiny_model(TinyModelSpec(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                                  num_key_value_heads=2, init_std=0.3, seed=seed), str(root / name))
             for name, seed in (("math", 1), ("geo", 2))}
    batch = _rollout_batch(AutoConfig.from_pretrained(paths["math"]).vocab_size)
    batch = Batch(batch.tensors, {"data_source": SOURCES}, {"temperature": TEMPERATURE})
    refs = {name: _reference(path, batch) for name, path in paths.items()}
    want = torch.stack([refs[src][b] for b, src in enumerate(SOURCES)])
    return paths, batch, refs, want


def _gathered(results, dp: int) -> torch.Tensor:
    return torch.cat([next(r[0] for r in results if r[1] == g and r[2] == 0) for g in range(dp)])


@pytest.mark.parametrize("world,ulysses", [(1, 1), (2, 1), (2, 2)])
def test_teacher_logprobs_equal_a_single_process_forward(setup, world, ulysses):
    paths, batch, refs, want = setup
    mask = batch["response_mask"].bool()
    assert float((refs["math"] - refs["geo"])[mask].abs().min()) > 1e-3  # the teachers differ on every token
    got = _gathered(run_distributed(_teacher_logprobs, world, paths, batch, ulysses), world // ulysses)
    assert got.shape == (B, R)
    assert float((got.double() - want).abs().max()) <= _logprob_tol(paths)
    assert bool((got[~mask] == 0).all())
    if ulysses == 2:  # Ulysses 2 against one rank, every element
        one = _gathered(run_distributed(_teacher_logprobs, 1, paths, batch, 1), 1)
        assert float((got - one).abs().max()) <= _logprob_tol(paths)


def _logprob_tol(paths: dict[str, str]) -> float:
    """Two computations of a teacher's logprob (tests/tolerances.py; the teachers share their shape)."""
    rtol, _, scale = tolerances(paths["math"])
    return scalar_tol(scale, rtol)


def _distilled(rank: int, world: int, paths: dict[str, str], batch: Batch) -> tuple[dict[str, torch.Tensor], int]:
    """The advantages of this dp shard as the workers compute them: the teachers' logprobs, then
    `TeacherRole.apply_distillation` on the same rows (distillation alone, and with the task advantage)."""
    cfg = _config(paths, world, 1)
    role = TeacherRole(RoleContext(cfg, rank, validate_config(cfg), torch.device("cpu"), pad_token_id=0))
    dims = role.engines["math"].dims
    shard = batch.chunk(dims.dp_size)[dims.dp_rank]
    rows = Batch.from_dict({k: shard[k] for k in DISTILL_READS if k != "teacher_logprobs"})
    rows.set("teacher_logprobs", role.compute_teacher_log_prob(shard, ["math", "geo"])["teacher_logprobs"])
    requests = {"alone": DistillRequest("k1", use_task_rewards=False), "combined": DistillRequest("k1", coef=0.25)}
    return {name: role.apply_distillation(rows, request)["advantages"] for name, request in requests.items()}, dims.dp_rank


def test_advantages_come_from_the_teacher_logprobs(setup):
    paths, batch, _, want = setup
    results = sorted(run_distributed(_distilled, 2, paths, batch), key=lambda r: r[1])
    got = {name: torch.cat([r[0][name] for r in results]) for name in ("alone", "combined")}
    mask, student = batch["response_mask"], batch["old_logprobs"]
    alone = got["alone"]
    hand = (want - student.double()) * mask  # -(s - q) on response tokens
    # the teacher's logprob error, plus fp32 rounding of the formula's few operations on values of hand's size
    formula = roundoff_rtol(reduction=1, stages=3)
    assert float((alone.double() - hand).abs().max()) <= _logprob_tol(paths) + scalar_tol(float(hand.abs().max()),
                                                                                          formula)
    task, combined = batch["advantages"], got["combined"]
    hand = (task.double() - 0.25 * (student.double() - want)) * mask
    assert float((combined.double() - hand).abs().max()) <= 0.25 * _logprob_tol(paths) + scalar_tol(
        float(hand.abs().max()), formula)
