"""End to end PPO: the critic on real Ray workers with vLLM rollouts.

* `python -m rlsp.main --config-name ppo` with the critic (and actor) at sp=2 and an adaptive KL
  penalty in the reward: completes, every critic metric is finite on every step, vLLM's logprobs
  match the trainer's after every weight sync (within test_sequence_layouts_e2e.run_logprob_tol), and the trained actor differs from the start;
* resumed from its step-2 checkpoint (critic, actor, adaptive KL coefficient), step 3 is bit for bit
  the uninterrupted run's step 3;
* a critic in its own resource pool with one warm-up step: the warm-up step moves the critic only,
  the next step moves both.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import ray
import torch
from omegaconf import OmegaConf
from test_grpo_e2e import SMALL, _main
from test_sequence_layouts_e2e import run_logprob_tol

from rlsp.checks.preflight import preflight
from rlsp.config.schema import RLSPConfig
from rlsp.config.validate import validate_config
from rlsp.controller.ray_session import init_ray
from rlsp.trainer.ray_trainer import RayTrainer

pytestmark = pytest.mark.e2e

CRITIC_KEYS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/vf_explained_var",
               "critic/grad_norm", "critic/values/mean", "critic/returns/mean", "critic/advantages/mean",
               "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff")


PPO_SP2 = ("critic.ulysses_sequence_parallel_size=2", "trainer.save_freq=2",
           "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "algorithm.use_kl_in_reward=true",
           "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.05", "algorithm.kl_ctrl.horizon=100",
           "critic.ppo_mini_batch_size=2", "critic.ppo_epochs=2", "actor_rollout_ref.actor.ppo_epochs=2")


def test_ppo_with_critic_sp2_through_the_cli(tmp_path):
    proc = _main(tmp_path, *PPO_SP2, config_name="ppo")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "sp self-check passed (critic)" in proc.stderr and "sp self-check passed (actor)" in proc.stderr
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3]
    for r in lines:
        for key in CRITIC_KEYS:
            assert isinstance(r[key], float) and math.isfinite(r[key]), (key, r.get(key))
        assert r["critic/vf_loss"] > 0 and r["critic/grad_norm"] > 0
        # Step 1 samples from the initial weights; later steps from weights synced after each update.
        assert r["rollout/logprob_diff_max"] <= run_logprob_tol(tmp_path / "run"), (r["step"], r["rollout/logprob_diff_max"])
    coeffs = [r["actor/reward_kl_penalty_coeff"] for r in lines]
    assert coeffs[0] == 0.05 and coeffs[1] != coeffs[0]  # the adaptive controller moved beta
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "actor_hf")
    initial = AutoModelForCausalLM.from_pretrained(tmp_path.parent / "cache" / "models" / "tiny-qwen2")
    with torch.no_grad():
        assert max(float((a - b).abs().max()) for a, b in zip(trained.parameters(), initial.parameters())) > 1e-5
    # Resume the same command from the step-2 checkpoint in a fresh directory: step 3 is identical.
    again = tmp_path / "again"
    (again / "run").mkdir(parents=True)
    shutil.copytree(tmp_path / "run" / "global_step_2", again / "run" / "global_step_2")
    proc = _main(again, *PPO_SP2, config_name="ppo")
    assert proc.returncode == 0 and "resumed from" in proc.stderr, proc.stderr[-4000:]
    resumed = [json.loads(x) for x in (again / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for key, value in lines[2].items():
        if not key.startswith(("timing/", "throughput/", "sp/a2a", "perf/")):  # perf/: traffic and memory of this process
            assert resumed[2][key] == value, (key, resumed[2][key], value)


@pytest.fixture(scope="module")
def ray_three_workers():
    init_ray(OmegaConf.structured(RLSPConfig), 3)
    yield
    ray.shutdown()


def test_separate_critic_pool_and_critic_warmup(tmp_path, ray_three_workers):
    cfg = OmegaConf.structured(RLSPConfig)
    overrides = {**SMALL, "trainer.default_local_dir": str(tmp_path / "run"), "trainer.cache_dir": str(tmp_path.parent / "cache"),
                 "algorithm.adv_estimator": "gae", "critic.colocate": False, "critic.n_gpus_per_node": 1,
                 "critic.optim.lr": 1e-3, "critic.ppo_mini_batch_size": 2, "trainer.critic_warmup": 1,
                 "trainer.val_before_train": False}
    for key, val in overrides.items():
        OmegaConf.update(cfg, key, val)
    layout = validate_config(cfg)
    trainer = RayTrainer(preflight(cfg), layout)
    try:
        infos = trainer.start_workers()
        assert sorted(tuple(i["roles"]) for i in infos) == [("critic",), ("rollout", "actor", "ref"),
                                                              ("rollout", "actor", "ref")]
        batches = trainer._batch_stream()
        checksums = [(trainer.wg.call("actor", "param_checksum")[0], trainer.critic_wg.call("critic", "param_checksum")[0])]
        for step in (1, 2):
            metrics = trainer.train_step(step, next(batches))
            assert math.isfinite(metrics["critic/vf_loss"])
            assert ("actor/pg_loss" in metrics) == (step == 2)  # step 1 is the critic's warm-up
            checksums.append((trainer.wg.call("actor", "param_checksum")[0],
                              trainer.critic_wg.call("critic", "param_checksum")[0]))
        (a0, c0), (a1, c1), (a2, c2) = checksums
        assert a1 == a0 and c1 != c0, "warm-up step must move the critic only"
        assert a2 != a1 and c2 != c1
    finally:
        trainer.shutdown()
