"""End to end: the real pipeline (Ray workers, FSDP2 over gloo, in-process vLLM) on the tiny model.

* `python -m rlsp.main` completes a short GRPO run and writes finite metrics and the reward plot;
* the policy weights change and vLLM's logprobs follow them (weight sync);
* the same rollout batch gets the same old logprobs at sp=2 as at sp=1;
logprob bounds (vLLM against the trainer, sp=2 against sp=1) are tests/tolerances.py's for two forwards of
the run's model (test_sequence_layouts_e2e.run_logprob_tol);
* a bad config fails before any worker has the run's config, naming the value.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch
from omegaconf import OmegaConf
from tolerances import scalar_tol

from rlsp.checks.preflight import preflight
from rlsp.config.schema import RLSPConfig
from rlsp.config.validate import validate_config
from rlsp.controller.ray_session import init_ray
from rlsp.run.checkpoint import step_dir
from rlsp.trainer.ray_trainer import RayTrainer
from rlsp.trainer.rollout_inputs import prompt_batch, sampling_params

pytestmark = pytest.mark.e2e

SMALL = {
    "actor_rollout_ref.rollout.name": "vllm",  # these tests compare vLLM's logprobs with the trainer's
    "data.train_batch_size": 4,
    "actor_rollout_ref.rollout.n": 4,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 3,
    "trainer.n_gpus_per_node": 2,
    "trainer.device": "cpu",
    "trainer.total_training_steps": 3,
    "trainer.test_freq": 2,
    "actor_rollout_ref.actor.optim.lr": 1e-3,
}


def _cfg(tmp_path, **overrides):
    cfg = OmegaConf.structured(RLSPConfig)
    for key, val in {**SMALL, "trainer.default_local_dir": str(tmp_path / "run"),
                     "trainer.cache_dir": str(tmp_path.parent / "cache"), **overrides}.items():
        OmegaConf.update(cfg, key, val)
    layout = validate_config(cfg)
    return preflight(cfg), layout


@pytest.fixture(scope="module")
def ray_session():
    init_ray(OmegaConf.structured(RLSPConfig), 2)
    yield
    ray.shutdown()


def _main(tmp_path, *overrides: str, config_name: str | None = None) -> subprocess.CompletedProcess:
    named = ["--config-name", config_name] if config_name else []
    cmd = [sys.executable, "-m", "rlsp.main", *named, *(f"{k}={v}" for k, v in SMALL.items()),
           f"trainer.default_local_dir={tmp_path / 'run'}", f"trainer.cache_dir={tmp_path.parent / 'cache'}", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_main_runs_grpo_and_writes_metrics(tmp_path):
    from test_sequence_layouts_e2e import run_logprob_tol  # it imports this module

    # verl's hf_model checkpoint content: every checkpoint also holds the actor in HF format.
    proc = _main(tmp_path, "actor_rollout_ref.actor.checkpoint.save_contents=[hf_model]")
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3]
    for r in lines:
        for key in ("reward/mean", "actor/pg_loss", "actor/kl_loss", "rollout/logprob_diff", "timing/step_s",
                    "throughput/tokens_per_s"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (key, r.get(key))
        assert 0.0 <= r["reward/mean"] <= 1.0
        # vLLM (fp32) and the trainer agree on the sampled tokens' logprobs before each update.
        assert r["rollout/logprob_diff"] <= run_logprob_tol(tmp_path / "run"), r["rollout/logprob_diff"]
    assert "val/accuracy" in lines[0] and "val/accuracy" in lines[1] and "val/accuracy" in lines[2]
    assert (tmp_path / "run" / "reward.png").stat().st_size > 1000
    assert (tmp_path / "run" / "run.log").exists() and not (tmp_path / "run" / "main.log").exists()  # no Hydra log
    # The trained actor is saved as a Hugging Face model that differs from the initial weights.
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "actor_hf")
    initial = AutoModelForCausalLM.from_pretrained(tmp_path.parent / "cache" / "models" / "tiny-qwen2")
    with torch.no_grad():
        deltas = [float((a - b).abs().max()) for a, b in zip(trained.parameters(), initial.parameters())]
    assert len(deltas) > 0 and max(deltas) > 1e-5
    assert (tmp_path / "run" / "actor_hf" / "generation_config.json").exists()
    # The last checkpoint's HF copy is the same step's weights as the final export, bit for bit; the
    # resumable shards are written as well.
    last = Path(step_dir(str(tmp_path / "run"), 3))
    copy = AutoModelForCausalLM.from_pretrained(last / "actor_hf")
    assert all(torch.equal(a, b) for a, b in zip(copy.parameters(), trained.parameters()))
    assert (last / "actor" / ".metadata").exists()


def test_main_hf_rollout_rloo_with_sp2(tmp_path):
    """The transformers rollout fallback, another estimator and Ulysses sp=2 through the same CLI."""
    from test_sequence_layouts_e2e import run_logprob_tol  # it imports this module

    proc = _main(tmp_path, "actor_rollout_ref.rollout.name=hf", "algorithm.adv_estimator=rloo",
                 "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "trainer.total_training_steps=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "sp self-check passed" in proc.stderr
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    for r in lines:
        assert r["rollout/logprob_diff"] <= run_logprob_tol(tmp_path / "run") and 0.0 <= r["reward/mean"] <= 1.0
        assert r["sp/tokens_per_rank"] > 0 and 0.0 <= r["sp/pad_fraction"] < 1.0 and r["sp/a2a_time_share"] > 0.0


def test_bad_config_fails_before_workers(tmp_path):
    proc = _main(tmp_path, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=3")
    assert proc.returncode == 2
    assert "ulysses_sequence_parallel_size=3" in proc.stderr and "legal values: [1, 2]" in proc.stderr
    assert "workers initialised" not in proc.stderr


def _rollout(trainer: RayTrainer) -> object:
    """Four prompts' samples, their columns read to the driver (the checks below read them, and the second
    trainer gets them by value: these workers are gone by then)."""
    items = [trainer.train_set[i] for i in range(4)]
    batch = trainer.wg.call("rollout", "generate", prompt_batch(items), sampling_params(trainer.cfg, 1))
    batch.info["temperature"] = 1.0
    return trainer.read(batch, ["input_ids", "attention_mask", "response_mask", "rollout_logprobs"])


def _old_logprobs(trainer: RayTrainer, batch: object) -> torch.Tensor:
    return trainer.read(trainer.wg.call("actor", "compute_log_prob", batch), ["old_logprobs"])["old_logprobs"]


def test_weights_change_sync_and_sp2_matches_sp1(tmp_path, ray_session):
    # An entropy bonus guarantees a non-zero gradient even if every sampled reward ties (no advantage).
    from test_sequence_layouts_e2e import config_tolerances

    cfg, layout = _cfg(tmp_path, **{"actor_rollout_ref.actor.entropy_coeff": 0.01})
    metric_rtol, _, scale = config_tolerances(cfg)
    tol = scalar_tol(scale, metric_rtol)  # two forwards of the model (tests/tolerances.py, derivation 4)
    trainer = RayTrainer(cfg, layout)
    try:
        trainer.start_workers()
        before = trainer.wg.call("actor", "param_checksum")[0]
        batch = _rollout(trainer)
        old_sp1 = _old_logprobs(trainer, batch)
        # Rollout logprobs of fp32 vLLM equal the trainer's before any update.
        mask = batch["response_mask"]
        assert float(((batch["rollout_logprobs"] - old_sp1).abs() * mask).max()) <= tol
        trainer.fit()
        after = trainer.wg.call("actor", "param_checksum")[0]
        assert abs(after - before) > 1e-4 * before, "training did not move the policy weights"
        # After the final sync, vLLM scores a fixed sequence exactly like the updated trainer.
        seq = batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist()
        vllm_lp = trainer.wg.call("rollout", "prompt_logprobs", seq)[0][1:]
        rows = batch.select_rows([0, 1])  # one row per dp rank
        trained = _old_logprobs(trainer, rows)[0]
        n_resp = int(rows["response_mask"][0].sum())
        assert torch.allclose(torch.tensor(vllm_lp[-n_resp:]), trained[:n_resp], rtol=0, atol=tol)
    finally:
        trainer.shutdown()

    trainer_sp2 = RayTrainer(*_cfg(tmp_path, **{"actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2}))
    try:
        trainer_sp2.start_workers()
        old_sp2 = _old_logprobs(trainer_sp2, batch)
        assert float((old_sp2 - old_sp1).abs().max()) <= tol
        assert trainer_sp2.check_sp(batch) <= tol
    finally:
        trainer_sp2.shutdown()
