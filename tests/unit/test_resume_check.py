"""The checks a resume runs before any worker has the run's config (rlsp.checks.resume_check), on real checkpoint files:
DCP shards written by torch.distributed.checkpoint, a model config, the trainer's own files.

* a truncated shard, a missing .metadata or a garbled trainer file is named; resume_mode=auto then
  takes the newest whole checkpoint before it, resume_mode=resume_path refuses;
* another architecture or a critic added/dropped is refused with both models described;
* a LoRA change that changes what the checkpoint holds (on/off, rank, adapted layers, starting adapter) is
  refused naming the key and both values; unused LoRA keys (LoRA off) may change;
* settings that change the course are listed, layout and bookkeeping keys are not;
* a checkpoint at trainer.total_training_steps is reported complete.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from transformers import Qwen2Config

from rlsp.checks.resume_check import changed_settings, check_resume
from rlsp.config.schema import RLSPConfig
from rlsp.run.checkpoint import CheckpointWriter, TrainerState, damaged_file


def _model(root, name: str, heads: int = 4, kv: int = 2, hidden: int = 128) -> str:
    path = str(root / name)
    Qwen2Config(hidden_size=hidden, intermediate_size=256, num_hidden_layers=2, num_attention_heads=heads,
                num_key_value_heads=kv, vocab_size=64, tie_word_embeddings=True).save_pretrained(path)
    return path


def _cfg(run_dir, model: str, **overrides):
    cfg = OmegaConf.structured(RLSPConfig)
    OmegaConf.update(cfg, "trainer.default_local_dir", str(run_dir))
    OmegaConf.update(cfg, "actor_rollout_ref.model.path", model)
    for key, val in overrides.items():
        OmegaConf.update(cfg, key, val)
    return cfg


def _dcp(path: str) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": {"w": torch.randn(64, 8), "b": torch.randn(8)}, "step": 3}, checkpoint_id=path,
                 no_dist=True)


def _save(cfg, step: int) -> str:
    """A checkpoint as the trainer writes it: DCP shards per role, the model config, RNG, trainer files."""
    writer = CheckpointWriter(cfg.trainer.default_local_dir, None, None)
    tmp = writer.begin(step)
    _dcp(os.path.join(tmp, "actor"))
    Qwen2Config.from_pretrained(cfg.actor_rollout_ref.model.path).save_pretrained(os.path.join(tmp, "actor", "huggingface"))
    if cfg.algorithm.adv_estimator == "gae":
        _dcp(os.path.join(tmp, "critic"))
    os.makedirs(os.path.join(tmp, "rng"))
    torch.save({"cpu": torch.get_rng_state()}, os.path.join(tmp, "rng", "policy_rank0_of1.pt"))
    state = TrainerState(step=step, epoch=0, batch_in_epoch=step, kl_ctrl={"value": 0.001}, layout="world=1")
    lines = [f'{{"step": {s}}}\n' for s in range(1, step + 1)]
    return writer.commit(tmp, step, state, lines, OmegaConf.to_yaml(cfg, resolve=True))


def _shard(ckpt: str) -> str:
    return os.path.join(ckpt, "actor", next(f for f in os.listdir(os.path.join(ckpt, "actor")) if f.endswith(".distcp")))


def test_damaged_files_are_named(tmp_path):
    cfg = _cfg(tmp_path / "run", _model(tmp_path, "m"))
    ckpt = _save(cfg, 2)
    assert damaged_file(ckpt) is None
    shard = _shard(ckpt)
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size - 10)
    assert damaged_file(ckpt) == f"{shard} is truncated ({size - 10} bytes; its records end at byte {size})"
    os.remove(shard)
    assert damaged_file(ckpt) == f"{shard} is missing"
    assert damaged_file(ckpt, ("actor", "critic")).startswith(f"{shard} is missing")
    other = _save(cfg, 3)
    assert "critic/.metadata is missing" in damaged_file(other, ("actor", "critic"))
    with open(os.path.join(other, "actor", ".metadata"), "wb") as f:
        f.write(b"\x80\x04garbage")
    assert damaged_file(other).startswith(os.path.join(other, "actor", ".metadata") + " is unreadable (")
    third = _save(cfg, 4)
    with open(os.path.join(third, "trainer_state.json"), "w") as f:
        f.write('{"step": 4, "epo')
    assert damaged_file(third).startswith(os.path.join(third, "trainer_state.json") + " is unreadable (")
    with open(os.path.join(_save(cfg, 5), "rng", "policy_rank0_of1.pt"), "wb") as f:
        f.write(b"PK\x03\x04")
    assert "rng/policy_rank0_of1.pt is unreadable" in damaged_file(os.path.join(tmp_path / "run", "global_step_5"))


def test_a_damaged_checkpoint_falls_back_or_is_refused(tmp_path, capsys):
    cfg = _cfg(tmp_path / "run", _model(tmp_path, "m"), **{"trainer.total_training_steps": 4})
    first, second = _save(cfg, 1), _save(cfg, 2)
    plan = check_resume(cfg)
    assert (plan.path, plan.step, plan.complete) == (second, 2, False)
    shard = _shard(second)
    with open(shard, "r+b") as f:
        f.truncate(100)
    plan = check_resume(cfg)
    assert (plan.path, plan.step) == (first, 1)
    err = capsys.readouterr().err
    assert f"checkpoint {second} cannot be resumed: {shard} is truncated" in err and f"resuming from {first}" in err
    named = _cfg(tmp_path / "new", cfg.actor_rollout_ref.model.path,
                 **{"trainer.resume_mode": "resume_path", "trainer.resume_from_path": second})
    with pytest.raises(ValueError, match=f"trainer.resume_from_path='{second}' cannot be resumed: {shard} is truncated"):
        check_resume(named)
    with open(_shard(first), "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="no older checkpoint there is whole"):
        check_resume(cfg)


def test_another_model_or_critic_is_refused(tmp_path):
    demo = _model(tmp_path, "demo")
    cfg = _cfg(tmp_path / "run", demo)
    _save(cfg, 2)
    other = _cfg(tmp_path / "run", _model(tmp_path, "other", heads=6, hidden=192), **{"algorithm.adv_estimator": "gae"})
    with pytest.raises(ValueError) as info:
        check_resume(other)
    text = str(info.value)
    assert text.startswith(f"cannot resume: run dir trainer.default_local_dir='{tmp_path / 'run'}' holds checkpoint "
                           "global_step_2, which this command cannot load:")
    assert (f"it was trained from actor model {demo} (qwen2: 2 layers, 4 attention / 2 kv heads of 32, hidden 128, "
            "intermediate 256, vocab 64, tied embeddings); this command trains actor_rollout_ref.model.path="
            f"{tmp_path / 'other'} (qwen2: 2 layers, 6 attention / 2 kv heads of 32, hidden 192") in text
    assert "— hidden_size 128 -> 192, num_attention_heads 4 -> 6\n" in text
    assert "its run had no critic (algorithm.adv_estimator='grpo'); this command has one" in text
    assert "new trainer.default_local_dir" in text
    # The other way round: a PPO checkpoint resumed with GRPO drops the critic.
    ppo = _cfg(tmp_path / "ppo", demo, **{"algorithm.adv_estimator": "gae"})
    _save(ppo, 1)
    with pytest.raises(ValueError, match="its run had a critic .algorithm.adv_estimator='gae'.; this command has none"):
        check_resume(_cfg(tmp_path / "ppo", demo))
    assert check_resume(ppo).step == 1
    # A checkpoint without the model config copy: the model its config.yaml names is compared instead.
    import shutil

    shutil.rmtree(tmp_path / "run" / "global_step_2" / "actor" / "huggingface")
    with pytest.raises(ValueError, match="num_attention_heads 4 -> 6"):
        check_resume(_cfg(tmp_path / "run", str(tmp_path / "other")))


def test_changed_settings_are_listed_and_a_finished_run_is_complete(tmp_path, capsys):
    model = _model(tmp_path, "m")
    cfg = _cfg(tmp_path / "run", model, **{"trainer.total_training_steps": 2})
    _save(cfg, 2)
    plan = check_resume(cfg)
    assert plan.complete and plan.step == 2
    assert "differ" not in capsys.readouterr().err
    changed = _cfg(tmp_path / "run", model, **{
        "actor_rollout_ref.actor.optim.lr": 5e-7, "data.train_batch_size": 8, "trainer.total_training_steps": 3,
        "trainer.n_gpus_per_node": 1, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2, "trainer.save_freq": 1})
    assert changed_settings(changed, OmegaConf.to_container(cfg, resolve=True)) == [
        "data.train_batch_size: 16 -> 8", "actor_rollout_ref.actor.optim.lr: 1e-06 -> 5e-07"]
    plan = check_resume(changed)
    assert not plan.complete
    err = capsys.readouterr().err
    assert "with settings that differ from its config.yaml" in err and "actor_rollout_ref.actor.optim.lr: 1e-06 -> 5e-07" in err
    # A key the checkpoint's config does not have yet compares with the schema default.
    saved = OmegaConf.to_container(cfg, resolve=True)
    del saved["actor_rollout_ref"]["actor"]["entropy_coeff"]
    assert changed_settings(cfg, saved) == []
    assert changed_settings(_cfg(tmp_path / "run", model, **{"actor_rollout_ref.actor.entropy_coeff": 0.01}),
                            saved) == ["actor_rollout_ref.actor.entropy_coeff: 0.0 -> 0.01"]


LORA = "actor_rollout_ref.model."


def _refusals(cfg) -> list[str]:
    with pytest.raises(ValueError) as info:
        check_resume(cfg)
    return [line for line in str(info.value).splitlines() if line.startswith("  - ")]


def test_lora_changes_that_change_what_the_checkpoint_holds_are_refused(tmp_path, capsys):
    model = _model(tmp_path, "m")
    lora = {f"{LORA}lora_rank": 8, f"{LORA}target_modules": "all-linear"}
    _save(_cfg(tmp_path / "run", model, **lora), 2)
    for key, value, old in ((f"{LORA}exclude_modules", ["o_proj"], None), (f"{LORA}target_modules", ["q_proj"], "all-linear"),
                            (f"{LORA}lora_rank", 16, 8), (f"{LORA}lora_rank", 0, 8),
                            (f"{LORA}lora_adapter_path", "/adapters/a", None)):
        problems = _refusals(_cfg(tmp_path / "run", model, **{**lora, key: value}))
        assert len(problems) == 1 and problems[0].startswith(f"  - {key} was {old!r}; this command sets {value!r}"), \
            (key, problems)
    # LoRA's scale changes the course, not the saved tensors: listed, not refused.
    assert check_resume(_cfg(tmp_path / "run", model, **lora, **{f"{LORA}lora_alpha": 32})).step == 2
    assert f"{LORA}lora_alpha: 16.0 -> 32.0" in capsys.readouterr().err


def test_a_full_checkpoint_refuses_lora_and_ignores_unused_lora_keys(tmp_path):
    model = _model(tmp_path, "m")
    _save(_cfg(tmp_path / "run", model), 2)
    problems = _refusals(_cfg(tmp_path / "run", model, **{f"{LORA}lora_rank": 8}))
    assert len(problems) == 1 and problems[0].startswith(f"  - {LORA}lora_rank was 0; this command sets 8")
    problems = _refusals(_cfg(tmp_path / "run", model, **{f"{LORA}lora_adapter_path": "/adapters/a"}))
    assert len(problems) == 1 and problems[0].startswith(f"  - {LORA}lora_adapter_path was None; this command sets "
                                                         "'/adapters/a'")
    # Without LoRA the adapter keys are unused: changing them changes nothing that was saved.
    unused = {f"{LORA}target_modules": ["q_proj"], f"{LORA}exclude_modules": "o_proj"}
    assert check_resume(_cfg(tmp_path / "run", model, **unused)).step == 2


def test_another_starting_adapter_is_refused(tmp_path):
    model = _model(tmp_path, "m")
    _save(_cfg(tmp_path / "run", model, **{f"{LORA}lora_adapter_path": "/adapters/a"}), 2)
    assert check_resume(_cfg(tmp_path / "run", model, **{f"{LORA}lora_adapter_path": "/adapters/a"})).step == 2
    problems = _refusals(_cfg(tmp_path / "run", model, **{f"{LORA}lora_adapter_path": "/adapters/b"}))
    assert len(problems) == 1 and problems[0].startswith(f"  - {LORA}lora_adapter_path was '/adapters/a'; this "
                                                         "command sets '/adapters/b'")
    # Dropping the adapter path with a rank keeps LoRA on, but the adapters' layout no longer comes from it.
    problems = _refusals(_cfg(tmp_path / "run", model, **{f"{LORA}lora_rank": 8}))
    assert [p[:60] for p in problems] == [f"  - {LORA}lora_rank was 0; this command sets 8"[:60],
                                          f"  - {LORA}lora_adapter_path was '/adapters/a'; this command "[:60]]
