"""verl's keys in rlsp: spellings mapped onto rlsp's, values refused with the reason, verl's rules.

Covers rlsp.config.verl_compat / validate_verl / run_length / choices, the prompt truncation and
file-order iteration of rlsp.data.dataset, and that every key of verl's example commands has a
status (declared, mapped, or refused by name).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from rlsp.config.choices import KL_ESTIMATOR_NAMES
from rlsp.config.run_length import resolve_total_steps, warmup_optimizer_steps
from rlsp.config.schema import RLSPConfig
from rlsp.config.validate import validate_config
from rlsp.config.validate_keys import schema_keys
from rlsp.config.verl_compat import verl_status
from rlsp.data.dataset import iterate_batches, truncate

COMMANDS = Path(__file__).resolve().parents[1] / "data" / "verl_commands.json"


def make(**overrides):
    cfg = OmegaConf.structured(RLSPConfig)
    for key, val in overrides.items():
        OmegaConf.update(cfg, key, val)
    return cfg


def _errors(cfg) -> str:
    with pytest.raises(ValueError) as err:
        validate_config(cfg)
    return str(err.value)


def test_verl_spellings_map_onto_rlsp_keys():
    cfg = make(**{"custom_reward_function.path": "/r.py", "custom_reward_function.name": "score",
                  "critic.optim.clip_grad": 0.3, "trainer.logger": "console"})
    validate_config(cfg)
    assert (cfg.reward.custom_function_path, cfg.reward.custom_function_name) == ("/r.py", "score")
    assert cfg.critic.optim.grad_clip == 0.3 and cfg.critic.optim.clip_grad is None
    assert cfg.custom_reward_function.path is None and list(cfg.trainer.logger) == ["console"]
    validate_config(cfg)  # idempotent
    same = make(**{"critic.optim.clip_grad": 0.3, "critic.optim.grad_clip": 0.3})
    validate_config(same)
    text = _errors(make(**{"critic.optim.clip_grad": 0.3, "critic.optim.grad_clip": 0.7}))
    assert "critic.optim.clip_grad=0.3 (verl's spelling) and critic.optim.grad_clip=0.7 are the same setting" in text


def test_both_kl_keys_take_the_same_estimator_names():
    for name in KL_ESTIMATOR_NAMES:
        validate_config(make(**{"actor_rollout_ref.actor.kl_loss_type": name, "algorithm.kl_penalty": name}))
    text = _errors(make(**{"algorithm.kl_penalty": "full"}))
    assert "algorithm.kl_penalty='full' is not supported; legal values: ['k1', 'kl', 'abs', 'k2', 'mse', 'k3'" in text


@pytest.mark.parametrize("key,value,needle", [
    ("actor_rollout_ref.rollout.name", "sglang", "(SGLang rollouts are not implemented (rlsp's engines: vllm, hf))"),
    ("actor_rollout_ref.actor.strategy", "megatron", "(Megatron-LM training is not implemented"),
    ("actor_rollout_ref.ref.strategy", "megatron", "actor_rollout_ref.ref.strategy='megatron' is not supported"),
    ("actor_rollout_ref.actor.loss_agg_mode", "seq-sum", "legal values: ['token-mean', 'seq-mean-token-sum', "
                                                         "'seq-mean-token-mean', 'seq-mean-token-sum-norm']"),
    ("critic.loss_agg_mode", "sum", "critic.loss_agg_mode='sum' is not supported; legal values: ['token-mean'"),
    ("actor_rollout_ref.actor.loss_scale_factor", 0, "loss_scale_factor=0 must be > 0"),
    ("trainer.device", "npu", "(Ascend NPUs are not supported"),
    ("data.truncation", "cut", "legal values: ['error', 'left', 'right', 'middle']"),
    ("actor_rollout_ref.rollout.mode", "server", "legal values: ['sync', 'async']"),
    ("actor_rollout_ref.rollout.free_cache_engine", False, "free_cache_engine=false is not supported"),
    ("actor_rollout_ref.rollout.multi_turn.format", "llama3_json",
     "format='llama3_json' is not supported; legal values: ['hermes', 'gpt-oss', 'qwen3_coder'"),
    ("actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side", "top", "legal values: ['left', 'middle', 'right']"),
    ("actor_rollout_ref.rollout.multi_turn.interaction_config_path", "i.yaml", "rlsp has no interaction classes"),
    ("actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts", 2, "num_repeat_rollouts=2 is not supported"),
    ("actor_rollout_ref.rollout.multi_turn.max_parallel_calls", 0, "max_parallel_calls=0 must be an integer >= 1"),
    ("actor_rollout_ref.rollout.agent.custom_async_server.path", "s.py", "custom_async_server.path/name are not supported"),
    ("trainer.use_legacy_worker_impl", "yes", "legal values: ['auto', 'enable', 'disable']"),
    ("actor_rollout_ref.model.fused_kernel_options.impl_backend", "cuda", "legal values: ['torch', 'triton']"),
    ("actor_rollout_ref.rollout.val_kwargs.temperature", 0.7, "do_sample=false validates greedily, so "),
    ("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", 1.5, "lr_warmup_steps_ratio=1.5 must be in [0, 1]"),
    ("trainer.total_training_steps", 0, "trainer.total_training_steps=0 must be an integer >= 1, or null"),
])
def test_values_rlsp_does_not_implement_are_refused_with_the_reason(key, value, needle):
    assert needle in _errors(make(**{key: value}))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_loss_aggregation_modes_compose_and_validate(mode):
    """verl's four loss_agg_modes are accepted; the critic's follows the actor's unless set (as in verl)."""
    cfg = make(**{"actor_rollout_ref.actor.loss_agg_mode": mode, "actor_rollout_ref.actor.loss_scale_factor": 4096,
                  "algorithm.adv_estimator": "gae"})
    validate_config(cfg)
    assert cfg.critic.loss_agg_mode == mode
    validate_config(make(**{"actor_rollout_ref.actor.loss_agg_mode": mode, "critic.loss_agg_mode": "token-mean"}))


def test_use_remove_padding_false_is_accepted_except_with_ulysses():
    """verl's padded forward computes what rlsp's packed one does; verl refuses it with Ulysses, so does rlsp."""
    validate_config(make(**{"actor_rollout_ref.model.use_remove_padding": False, "critic.model.use_remove_padding": False,
                            "algorithm.adv_estimator": "gae"}))
    assert "has no effect on results" in verl_status("actor_rollout_ref.model.use_remove_padding",
                                                     set(schema_keys()))
    text = _errors(make(**{"actor_rollout_ref.model.use_remove_padding": False, "trainer.n_gpus_per_node": 2,
                           "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2,
                           "critic.model.use_remove_padding": False, "critic.ulysses_sequence_parallel_size": 2,
                           "algorithm.adv_estimator": "gae"}))
    assert ("actor_rollout_ref.model.use_remove_padding=false with actor_rollout_ref.actor.ulysses_sequence_parallel_size"
            "=2 is not supported: verl requires use_remove_padding=true") in text
    assert "critic.model.use_remove_padding=false with critic.ulysses_sequence_parallel_size=2" in text


def test_use_shm_needs_one_node_and_two_warmups_conflict():
    text = _errors(make(**{"actor_rollout_ref.model.use_shm": True, "trainer.nnodes": 2,
                           "critic.optim.lr_warmup_steps": 3, "critic.optim.lr_warmup_steps_ratio": 0.1}))
    assert "use_shm=true with trainer.nnodes=2" in text
    assert "critic.optim.lr_warmup_steps=3 and critic.optim.lr_warmup_steps_ratio=0.1 both set a warm-up" in text


def test_run_length_and_warmup_follow_verl():
    cfg = make(**{"data.train_batch_size": 8, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
                  "actor_rollout_ref.actor.ppo_epochs": 2, "trainer.total_epochs": 3,
                  "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.25})
    assert resolve_total_steps(cfg, 33) == 12  # 3 epochs x 4 full batches (the last 1 prompt is dropped)
    assert warmup_optimizer_steps(cfg, "actor") == 3 * 8  # 0.25 x 12 steps, x 4 mini-batches x 2 epochs
    cfg.actor_rollout_ref.actor.optim.lr_warmup_steps = 2
    cfg.actor_rollout_ref.actor.optim.lr_warmup_steps_ratio = 0.0
    assert warmup_optimizer_steps(cfg, "actor") == 16 and warmup_optimizer_steps(cfg, "critic") == 0
    explicit = make(**{"data.train_batch_size": 8, "trainer.total_training_steps": 5})
    assert resolve_total_steps(explicit, 40) == 5
    explicit.trainer.total_epochs = 1
    with pytest.raises(ValueError, match="total_training_steps=5 exceeds trainer.total_epochs=1 x 4 batches per epoch = 4 steps"):
        resolve_total_steps(explicit, 39)


def test_unset_token_budgets_and_critic_batches_follow_the_actor():
    cfg = make(**{"actor_rollout_ref.actor.use_dynamic_bsz": True, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu":
                  999, "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "actor_rollout_ref.actor.ppo_epochs": 3})
    arr = cfg.actor_rollout_ref
    assert arr.ref.log_prob_use_dynamic_bsz and arr.rollout.log_prob_use_dynamic_bsz and cfg.critic.use_dynamic_bsz
    assert arr.ref.log_prob_max_token_len_per_gpu == arr.rollout.log_prob_max_token_len_per_gpu == 999
    assert (cfg.critic.ppo_mini_batch_size, cfg.critic.ppo_epochs) == (4, 3)
    cfg.critic.ppo_micro_batch_size_per_gpu = 5
    assert cfg.critic.forward_micro_batch_size_per_gpu == 5


def test_truncation_and_file_order():
    ids = list(range(10))
    assert truncate(ids, 4, "left") == [6, 7, 8, 9] and truncate(ids, 4, "right") == [0, 1, 2, 3]
    assert truncate(ids, 5, "middle") == [0, 1, 7, 8, 9] and truncate(ids, 20, "left") == ids
    items = [SimpleNamespace(i=i) for i in range(7)]
    assert [[x.i for x in b] for b in iterate_batches(items, 3, seed=1, epoch=0, shuffle=False)] == [[0, 1, 2], [3, 4, 5]]
    shuffled = [x.i for b in iterate_batches(items, 3, seed=1, epoch=0) for x in b]
    assert len(set(shuffled)) == 6 and shuffled != sorted(shuffled)  # data.shuffle=true (the default)


def test_every_key_of_verl_examples_has_a_status():
    declared = set(schema_keys())
    keys = {a.lstrip("+").partition("=")[0] for c in json.loads(COMMANDS.read_text())["commands"] for a in c["args"]}
    unknown = sorted(k for k in keys if verl_status(k, declared).startswith("unknown"))
    assert not unknown, f"give these verl keys a meaning or a refusal in rlsp.config.verl_compat: {unknown}"
