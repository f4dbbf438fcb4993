"""End to end: 2 GRPO steps of each new model family through rlsp's own entry, at Ulysses 2 with hf rollouts.

`rlsp.main.run` (validation, preflight, Ray workers, an FSDP2 actor at ulysses_sequence_parallel_size=2 over gloo,
the reference, transformers-generate rollouts, the weight sync into that engine after every update, GRPO) on the
tiny gpt-oss (windows + sinks + MoE), DeepSeek-V3 (multi-latent attention + MoE), Qwen3-Next (Gated DeltaNet +
MoE) and Gemma 2 (windows, soft-capping) models of tests/tiny_*.py, two CPU workers sharing test_grpo_e2e's Ray
session. vLLM on CPU is refused for the first three (rlsp/rollout/support.py), so every family uses
rollout.name=hf. Checked per family:
* both steps finish, with finite metrics, and the start-up self-check (Ulysses 2 against an unsharded forward on
  the first step's rows) passed;
* the update moved the policy: a non-zero gradient norm (an entropy bonus guarantees one even if every sampled
  reward of a group ties);
* on both steps the largest per-token gap between the rollout engine's sampling logprobs and the trainer's
  (`rollout/logprob_diff_max`) is within tests/tolerances.py's bound for two forwards of the run's model
  (test_sequence_layouts_e2e.run_logprob_tol). Step 2's rollouts were generated after step 1's update was
  synced, so its gap proves the engine holds the trained weights: a missing or partial sync (a module swapped by
  rlsp/models/linear_attention.py, an MLA or expert weight renamed) leaves it at the update's size, far above.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from test_grpo_e2e import ray_session  # noqa: F401 (the module's shared Ray session)
from test_sequence_layouts_e2e import run_logprob_tol
from tiny_deepseek import write_tiny_deepseek
from tiny_gemma import write_tiny_gemma
from tiny_gpt_oss import write_tiny_gpt_oss
from tiny_linear import write_tiny_linear

from rlsp.config.schema import RLSPConfig

pytestmark = pytest.mark.e2e

BUILDERS = {
    "gpt_oss": write_tiny_gpt_oss,
    "deepseek_v3": lambda out: write_tiny_deepseek("v3", out),
    "qwen3_next": lambda out: write_tiny_linear("qwen3_next", out),
    "gemma2": lambda out: write_tiny_gemma("gemma2", out),
}
OVERRIDES = {
    "actor_rollout_ref.rollout.name": "hf",
    "actor_rollout_ref.rollout.n": 4,
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 2,  # two updates per step: the update's own logprobs stay apart
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4,
    "actor_rollout_ref.actor.optim.lr": 1e-3,
    "actor_rollout_ref.actor.entropy_coeff": 0.01,
    "data.train_batch_size": 2,
    "data.max_response_length": 6,
    "trainer.n_gpus_per_node": 2,
    "trainer.device": "cpu",
    "trainer.total_training_steps": 2,
    "trainer.val_before_train": False,
    "trainer.test_freq": -1,
    "trainer.save_final_model": False,
    "trainer.plot": False,
}
FINITE = ("reward/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm",
          "rollout/logprob_diff", "rollout/logprob_diff_max", "sp/tokens_per_rank", "timing/step_s")


def _config(model_path: str, run_dir: Path):
    cfg = OmegaConf.structured(RLSPConfig)
    for key, val in {**OVERRIDES, "actor_rollout_ref.model.path": model_path,
                     "trainer.default_local_dir": str(run_dir / "run"),
                     "trainer.cache_dir": str(run_dir / "cache")}.items():
        OmegaConf.update(cfg, key, val)
    return cfg


@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_family_grpo_two_steps_ulysses2_hf_rollouts(tmp_path: Path, family: str, capsys) -> None:
    from rlsp.main import run

    model_path = BUILDERS[family](str(tmp_path / family))
    history = run(_config(model_path, tmp_path))
    assert [m["step"] for m in history] == [1, 2]
    assert "sp self-check passed (actor)" in capsys.readouterr().err  # the actor's forward ran at Ulysses 2
    tol = run_logprob_tol(tmp_path / "run")
    for metrics in history:
        for key in FINITE:
            assert isinstance(metrics[key], float) and math.isfinite(metrics[key]), (family, key, metrics.get(key))
        assert metrics["actor/grad_norm"] > 0.0, (family, metrics["actor/grad_norm"])
        assert metrics["sp/tokens_per_rank"] > 0.0
        # the rollout engine's logprobs are the trainer's: at load (step 1) and after the first sync (step 2)
        assert metrics["rollout/logprob_diff_max"] <= tol, (family, metrics["step"], metrics["rollout/logprob_diff_max"], tol)
