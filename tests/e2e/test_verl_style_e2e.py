"""verl-style command lines train through `python -m rlsp.main --config-name verl` (CPU, tiny model).

A GRPO and a PPO command written the way verl's examples are (verl's keys and spellings: data.truncation,
return_raw_chat, use_remove_padding, lr_warmup_steps_ratio, trainer.logger as one name,
custom_reward_function.*, rollout.val_kwargs.*, ...) each train for two steps on two
CPU workers with the HF rollout. The run length comes from verl's rule (one epoch of 8 prompts in
batches of 4, no total_training_steps), the warm-up ramps the learning rate over the first step, the
custom reward function given in verl's spelling scores the samples, and validation takes
val_kwargs.n samples per prompt.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlsp.data.tasks.arithmetic import write_arithmetic_parquet

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
REWARD = '''
import os

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    open(os.path.join(os.path.dirname(__file__), "called"), "a").close()
    return 1.0 if solution_str.strip().startswith(str(ground_truth)) else 0.1 * (len(solution_str) % 3)
'''


def _common(tmp_path: Path) -> list[str]:
    train, test = write_arithmetic_parquet(str(tmp_path / "data"), n_train=8, n_test=3)
    (tmp_path / "reward.py").write_text(REWARD)
    return [
        f"data.train_files={train}", f"data.val_files={test}", "data.train_batch_size=4",
        "data.max_prompt_length=32", "data.max_response_length=8", "data.filter_overlong_prompts=True",
        "data.truncation=error", "data.return_raw_chat=True", "data.shuffle=False",
        "actor_rollout_ref.model.path=builtin://tiny-qwen2", "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.5",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        f"custom_reward_function.path={tmp_path / 'reward.py'}", "custom_reward_function.name=compute_score",
        "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0", "trainer.n_gpus_per_node=2",
        "trainer.nnodes=1", "trainer.device=cpu", "trainer.save_freq=1", "trainer.test_freq=2", "trainer.total_epochs=1",
        f"trainer.default_local_dir={tmp_path / 'run'}", f"trainer.cache_dir={tmp_path.parent / 'cache'}",
    ]


GRPO = [
    "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.val_kwargs.n=2",
    "actor_rollout_ref.rollout.val_kwargs.do_sample=True", "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    "trainer.logger=console", "trainer.project_name=verl_grpo_example", "trainer.experiment_name=tiny",
]
PPO = [
    "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=False", "critic.optim.lr=1e-3",
    "critic.optim.lr_warmup_steps_ratio=0.5", "critic.model.use_remove_padding=True",
    "critic.model.path=builtin://tiny-qwen2", "critic.model.enable_gradient_checkpointing=True",
    "critic.ppo_micro_batch_size_per_gpu=4", "trainer.logger=['console','jsonl']",
    "trainer.val_before_train=False", "trainer.use_legacy_worker_impl=auto", "trainer.project_name=verl_example",
    "trainer.experiment_name=tiny_ppo",
]


def _run(tmp_path: Path, extra: list[str]) -> list[dict]:
    args = [*_common(tmp_path), *extra]
    env = {**os.environ, "RLSP_LOG_LEVEL": "INFO"}
    check = subprocess.run([sys.executable, "-m", "rlsp.check", "--config-name", "verl", *args], capture_output=True,
                           text=True, timeout=300, cwd=ROOT, env=env)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-2000:]
    assert "run: 2 steps (1 epochs x 2 batches; 8 training prompts, 2 batches per epoch)" in check.stdout
    proc = subprocess.run([sys.executable, "-m", "rlsp.main", "--config-name", "verl", *args], capture_output=True,
                          text=True, timeout=900, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = (tmp_path / "run" / "global_step_2" / "metrics.jsonl").read_text().splitlines()
    assert not (tmp_path / "run" / "global_step_3").exists()
    assert (tmp_path / "called").exists()  # custom_reward_function.path scored the samples
    return [json.loads(x) for x in lines]


def _warmed_up(records: list[dict], key: str, lr: float) -> None:
    """Warm-up over the first training step (ratio 0.5 of 2): its mean rate is below lr, the second's is lr."""
    assert records[0][key] < lr and math.isclose(records[1][key], lr, rel_tol=1e-6), [r[key] for r in records]


def test_verl_style_grpo_two_steps(tmp_path):
    records = _run(tmp_path, GRPO)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        for key in ("reward/mean", "actor/pg_loss", "actor/kl_loss", "timing/step_s"):
            assert math.isfinite(r[key]), (key, r)
    _warmed_up(records, "actor/lr", 1e-3)
    val = records[1]  # test_freq=2: after step 2 (and before training)
    assert val["val/num_prompts"] == 3 and val["val/num_samples"] == 6  # val_kwargs.n=2
    assert "val/num_samples" in records[0]  # val_before_train (verl's default)


def test_verl_style_ppo_two_steps(tmp_path):
    records = _run(tmp_path, PPO)
    assert [r["step"] for r in records] == [1, 2]
    assert "val/num_samples" not in records[0]  # trainer.val_before_train=False
    for r in records:
        for key in ("critic/vf_loss", "critic/grad_norm", "actor/pg_loss"):
            assert math.isfinite(r[key]), (key, r)
    _warmed_up(records, "actor/lr", 1e-3)
    _warmed_up(records, "critic/lr", 1e-3)
    # trainer.logger as a list: jsonl wrote the same records the checkpoint keeps
    written = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in written] == [1, 2]
