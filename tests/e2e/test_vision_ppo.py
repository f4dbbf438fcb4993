"""End to end: 2 PPO steps of a vision-language model with its critic on the same images, through rlsp's own entry.

tests/e2e/test_vision_grpo.py's run (a tiny random Qwen2.5-VL with its real processor files, the synthetic shapes task,
hf rollouts with the images, the actor at Ulysses 2) with algorithm.adv_estimator=gae: the critic starts from the
same vision-language model (critic.model.path unset), loads it with its vision tower and reads the rows' images in
compute_values and update_critic (rlsp.models.value.VisionValueModel, Ulysses 2). Checked, besides the vision run's
own checks (both steps finite, the actor's start-up self-check, the engine-trainer logprob gap):
* the critic's start-up self-check passed: its values at Ulysses 2 on the first step's image rows equal an unsharded
  forward's within trainer.sp_self_check_tol;
* on both steps every critic metric is finite and the critic's update moved it (a non-zero gradient norm).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_grpo_e2e import ray_session  # noqa: F401 (the module's shared Ray session)
from test_ppo_e2e import CRITIC_KEYS
from test_vision_grpo import _vl_model, run_vision_grpo

pytestmark = pytest.mark.e2e

CRITIC = {"algorithm.adv_estimator": "gae", "critic.ulysses_sequence_parallel_size": 2,
          "critic.ppo_micro_batch_size_per_gpu": 4, "critic.optim.lr": 1e-3, "trainer.critic_warmup": 0}


class _KeptOutput:
    """capsys whose captured output stays readable after run_vision_grpo has read it."""

    def __init__(self, capsys) -> None:
        self.capsys, self.err = capsys, ""

    def readouterr(self):
        out = self.capsys.readouterr()
        self.err += out.err
        return out


@pytest.mark.usefixtures("ray_session")
def test_vision_language_ppo_two_steps_with_the_critic_on_the_images(tmp_path: Path, capsys) -> None:
    kept = _KeptOutput(capsys)
    history = run_vision_grpo(tmp_path, _vl_model(tmp_path / "model"), kept, **CRITIC)
    assert "sp self-check passed (critic)" in kept.err  # image rows at Ulysses 2 == unsharded, values
    for metrics in history:
        for key in CRITIC_KEYS:
            if key.startswith("critic/"):
                assert isinstance(metrics[key], float) and math.isfinite(metrics[key]), (key, metrics.get(key))
        assert metrics["critic/grad_norm"] > 0.0
