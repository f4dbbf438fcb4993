"""verl's other key spellings (rlsp.config.verl_spellings), its engine and runtime keys
(rlsp.config.schema_verl_runtime / validate_verl_runtime) and the validation-sample log (trainer.log_val_generations)."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from rlsp.config.auto import resolve_auto
from rlsp.config.compose import CommandLine, compose_collecting, verl_argv
from rlsp.config.schema import RLSPConfig
from rlsp.config.validate_verl_runtime import check_verl_runtime_keys
from rlsp.config.verl_compat import refusal, verl_key_notes, verl_note, verl_status
from rlsp.config.verl_spellings import rename_overrides, rlsp_key
from rlsp.data.batch import Batch
from rlsp.models.tokenizer import build_char_tokenizer
from rlsp.rollout.engine_options import vllm_engine_options
from rlsp.trainer.val_generations import ValGenerationLog


@pytest.mark.parametrize(("verl", "rlsp"), [
    ("critic.fsdp.param_offload", "critic.model.fsdp_config.param_offload"),
    ("critic.fsdp.ulysses_sequence_parallel_size", "critic.ulysses_sequence_parallel_size"),
    ("reward.reward_model.enable", "reward_model.enable"),
    ("reward.reward_model.model_path", "reward_model.model.path"),
    ("reward.reward_model.rollout.tensor_model_parallel_size", "reward_model.rollout.tensor_model_parallel_size"),
    ("reward.custom_reward_function.path", "custom_reward_function.path"),
    ("reward_model.reward_kwargs.overlong_buffer_cfg.len", "reward.reward_kwargs.overlong_buffer_cfg.len"),
    ("actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size", "actor_rollout_ref.ref.ulysses_sequence_parallel_size"),
    ("actor_rollout_ref.actor.fsdp_config.strategy", "actor_rollout_ref.actor.strategy"),
    ("actor_rollout_ref.ref.fsdp_config.entropy_from_logits_with_chunking",
     "actor_rollout_ref.ref.entropy_from_logits_with_chunking"),
    ("actor_rollout_ref.actor.grad_clip", "actor_rollout_ref.actor.optim.grad_clip"),
    ("actor_rollout_ref.actor.tau_pos", "actor_rollout_ref.actor.policy_loss.tau_pos"),
    ("actor_rollout_ref.model.torch_dtype", "actor_rollout_ref.model.dtype"),
    ("actor_rollout_ref.actor.ulysses_sequence_parallel_size", "actor_rollout_ref.actor.ulysses_sequence_parallel_size"),
])
def test_rlsp_key_of_each_spelling(verl, rlsp):
    assert rlsp_key(verl) == rlsp


def test_rename_keeps_signs_order_and_adds_the_reward_loop_once():
    out, problems = rename_overrides(["data.train_batch_size=8", "+reward_model.reward_kwargs.max_resp_len=64",
                                      "~critic.fsdp.param_offload", "reward.reward_model.enable=True",
                                      "reward.reward_model.model_path=/rm"])
    assert problems == []
    assert out == ["data.train_batch_size=8", "+reward.reward_kwargs.max_resp_len=64",
                   "~critic.model.fsdp_config.param_offload", "reward_model.enable=True", "reward_model.model.path=/rm",
                   "reward_model.use_reward_loop=true"]
    out, _ = rename_overrides(["reward.reward_model.enable=True", "reward_model.use_reward_loop=false"])
    assert out == ["reward_model.enable=True", "reward_model.use_reward_loop=false"]  # the user's value stays


def test_one_setting_under_both_spellings():
    same, problems = rename_overrides(["actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
                                       "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size=2"])
    assert same == ["actor_rollout_ref.ref.ulysses_sequence_parallel_size=2"] and problems == []
    _, problems = rename_overrides(["critic.model.fsdp_config.param_offload=true", "critic.fsdp.param_offload=false"])
    assert problems == ["critic.model.fsdp_config.param_offload=true and critic.fsdp.param_offload=false set "
                        "critic.model.fsdp_config.param_offload twice (verl's two spellings of one setting) with "
                        "different values; set it once"]
    # the same key written twice in rlsp's spelling is Hydra's business (the last one wins), not a conflict
    out, problems = rename_overrides(["trainer.nnodes=1", "trainer.nnodes=2"])
    assert out == ["trainer.nnodes=1", "trainer.nnodes=2"] and problems == []


def test_verl_argv_for_rlsp_main(capsys):
    argv = ["--config-name", "verl", "critic.fsdp.param_offload=True", "+trainer.total_epochs=3"]
    assert verl_argv(argv) == ["--config-name", "verl", "critic.model.fsdp_config.param_offload=True",
                               "trainer.total_epochs=3"]
    with pytest.raises(SystemExit) as exc:
        verl_argv(["critic.fsdp.param_offload=True", "critic.model.fsdp_config.param_offload=False"])
    assert exc.value.code == 2 and "set critic.model.fsdp_config.param_offload twice" in capsys.readouterr().err


def test_vllm_engine_kwargs_compose_with_or_without_plus():
    for sign in ("+", ""):
        cfg, problems = compose_collecting(CommandLine("verl", [
            f"{sign}actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config={{method: suffix}}",
            "ray_kwargs.ray_init.num_cpus=16"]))
        assert problems == [], problems
        assert OmegaConf.to_container(cfg.actor_rollout_ref.rollout.engine_kwargs.vllm) == {
            "speculative_config": {"method": "suffix"}}
        assert cfg.ray_kwargs.ray_init.num_cpus == 16


def _cfg(**updates):
    cfg = OmegaConf.structured(RLSPConfig)
    for key, value in updates.items():
        OmegaConf.update(cfg, key.replace("__", "."), value, force_add=True)
    errors: list[str] = []
    resolve_auto(cfg, errors)  # as the config stage does first (the rollout engine is one of its keys)
    check_verl_runtime_keys(cfg, errors)
    return errors


def test_defaults_pass():
    assert _cfg() == []


@pytest.mark.parametrize(("key", "value", "words"), [
    ("actor_rollout_ref.rollout.data_parallel_size", 2, "data_parallel_size=2 is not supported"),
    ("actor_rollout_ref.rollout.max_num_seqs", 0, "max_num_seqs=0 must be an integer >= 1"),
    ("actor_rollout_ref.rollout.engine_kwargs.vllm", {"dtype": "float16"},
     "engine_kwargs.vllm.dtype is set by rlsp from actor_rollout_ref.rollout.dtype"),
    ("actor_rollout_ref.rollout.checkpoint_engine.backend", "mooncake", "legal values: ['naive', 'nccl']"),
    ("actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes", 0,
     "update_weights_bucket_megabytes=0 must be an integer >= 1"),
    ("actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs", {"x": 1}, "engine_kwargs={'x': 1} is not supported"),
    ("actor_rollout_ref.actor.checkpoint.save_contents", ["model"], "save_contents=['model'] is not supported"),
    ("critic.checkpoint.load_contents", ["model", "hf_model"], "hf_model (an HF-format copy in every checkpoint)"),
    ("critic.checkpoint.save_contents", ["hf_model"], "the actor's save_contents only"),
    ("actor_rollout_ref.actor.checkpoint.save_contents", ["model", "hf_model"], "legal: ['model', 'optimizer', 'extra'], ['hf_model']"),
    ("actor_rollout_ref.actor.checkpoint.async_save", True, "async_save=true is not supported"),
    ("data.filter_overlong_prompts_workers", 0, "filter_overlong_prompts_workers=0 must be an integer >= 1"),
    ("trainer.log_val_generations", -1, "log_val_generations=-1 must be an integer >= 0"),
    ("ray_kwargs.timeline_json_file", "/tmp/t.json", "legal values: [null]"),
])
def test_refused_values_name_the_key(key, value, words):
    errors = _cfg(**{key.replace(".", "__"): value})
    assert len(errors) == 1 and words in errors[0] and key.rsplit(".", 1)[-1] in errors[0], errors


def test_chunked_prefill_off_needs_a_whole_sequence_per_step():
    errors = _cfg(actor_rollout_ref__rollout__enable_chunked_prefill=False, data__max_prompt_length=4096,
                  data__max_response_length=8192, actor_rollout_ref__rollout__max_num_batched_tokens=8192)
    assert errors == ["actor_rollout_ref.rollout.max_num_batched_tokens=8192 is smaller than a whole sequence "
                      "(data.max_prompt_length + data.max_response_length = 12288) with actor_rollout_ref.rollout."
                      "enable_chunked_prefill=false: vLLM could not schedule a long prompt; raise it or enable chunked "
                      "prefill"]
    assert _cfg(actor_rollout_ref__rollout__enable_chunked_prefill=True, data__max_prompt_length=4096,
                data__max_response_length=8192) == []


def test_ray_num_cpus():
    assert _cfg(trainer__device="cuda", trainer__n_gpus_per_node=8, ray_kwargs__ray_init__num_cpus=8) == []
    assert _cfg(trainer__device="cuda", trainer__nnodes=2, trainer__n_gpus_per_node=8,
                ray_kwargs__ray_init__num_cpus=8) == [
        "ray_kwargs.ray_init.num_cpus=8 is fewer than the run's 16 workers (each holds one CPU slot); raise it or leave "
        "it null"]
    assert "with trainer.device=cpu is not supported" in _cfg(trainer__device="cpu", ray_kwargs__ray_init__num_cpus=4)[0]


def test_vllm_engine_options_on_gpu_and_cpu():
    r = OmegaConf.structured(RLSPConfig).actor_rollout_ref.rollout
    r.engine_kwargs.vllm = {"disable_log_stats": False}
    assert vllm_engine_options(r, 12288, on_gpu=True) == {
        "max_num_batched_tokens": 8192, "max_num_seqs": 256, "disable_log_stats": False, "enable_chunked_prefill": True}
    # CPU: no chunked prefill (seeded sampling), so a step holds a whole sequence
    assert vllm_engine_options(r, 12288, on_gpu=False) == {
        "max_num_batched_tokens": 12288, "max_num_seqs": 256, "disable_log_stats": False}


def test_notes_and_refusals_of_the_new_keys():
    assert verl_note("critic.fsdp.param_offload").startswith(
        "verl's other spelling of critic.model.fsdp_config.param_offload (rewritten onto it); FSDP2's CPUOffloadPolicy")
    assert "reward_model.use_reward_loop=true" in verl_note("reward.reward_model.enable")
    assert verl_status("critic.fsdp.param_offload", set()) == (
        "verl's other spelling of `critic.model.fsdp_config.param_offload` (rewritten onto it)")
    assert "always works in vocabulary chunks" in verl_note("actor_rollout_ref.ref.entropy_from_logits_with_chunking")
    assert refusal("ray_kwargs.ray_init.namespace").startswith(
        "ray_kwargs.ray_init.namespace is not supported: rlsp starts its private Ray with num_cpus, "
        "object_store_memory and runtime_env (env_vars, py_executable) only")
    assert "config.json" in refusal("actor_rollout_ref.model.override_config.max_position_embeddings")


def test_val_generations_log(tmp_path):
    tok = build_char_tokenizer()
    pad = tok.pad_token_id
    p1, r1 = tok.encode("12+3=", add_special_tokens=False), tok.encode("15", add_special_tokens=False)
    p2, r2 = tok.encode("7-2=", add_special_tokens=False), tok.encode("5", add_special_tokens=False)
    P = 5  # prompt width (left-padded); the responses take the remaining 3 columns
    ids = torch.tensor([p1 + r1 + [pad], [pad] + p2 + r2 + [pad, pad]])
    attention = torch.tensor([[1] * 5 + [1, 1, 0], [0] + [1] * 4 + [1, 0, 0]])
    batch = Batch.from_dict({"input_ids": ids, "attention_mask": attention,
                             "response_mask": attention[:, P:].clone()})
    cfg = OmegaConf.structured(RLSPConfig)
    cfg.trainer.default_local_dir = str(tmp_path / "run")
    assert ValGenerationLog.build(cfg, tok) is None  # verl's default 0: off
    cfg.trainer.log_val_generations = 1
    log = ValGenerationLog.build(cfg, tok)
    log.write(batch, torch.tensor([1.0, 0.0]).numpy())
    cfg.trainer.log_val_generations = 5  # more than the batch holds: every row
    log5 = ValGenerationLog.build(cfg, tok)
    log5.validations = 1
    log5.write(batch, torch.tensor([0.5, 1.0]).numpy())
    lines = [json.loads(x) for x in (tmp_path / "run" / "val_generations.jsonl").read_text().splitlines()]
    assert lines == [
        {"validation": 0, "sample": 0, "prompt": "12+3=", "response": "15", "score": 1.0},
        {"validation": 1, "sample": 0, "prompt": "12+3=", "response": "15", "score": 0.5},
        {"validation": 1, "sample": 1, "prompt": "7-2=", "response": "5", "score": 1.0},
    ]


def test_a_refused_key_is_named_as_written():
    _, problems = compose_collecting(CommandLine("verl", ["reward.reward_model.enable_resource_pool=False"]))
    assert problems == ["reward.reward_model.enable_resource_pool (verl's other spelling of "
                        "reward_model.enable_resource_pool) is not supported: a reward-model pool of its own is not "
                        "supported: the reward model runs on the policy workers (reward_model.ulysses_sequence_parallel_"
                        "size and model.fsdp_config shard it there)"]


def test_start_up_notes_of_a_command():
    notes = verl_key_notes(["--config-name", "verl", "actor_rollout_ref.rollout.calculate_log_probs=True",
                            "+actor_rollout_ref.ref.entropy_from_logits_with_chunking=True", "data.train_batch_size=8",
                            "actor_rollout_ref.rollout.calculate_log_probs=False"])
    assert notes == [f"actor_rollout_ref.rollout.calculate_log_probs: {verl_note('actor_rollout_ref.rollout.calculate_log_probs')}",
                     "actor_rollout_ref.ref.entropy_from_logits_with_chunking: "
                     f"{verl_note('actor_rollout_ref.ref.entropy_from_logits_with_chunking')}"]
    assert notes[0].startswith("actor_rollout_ref.rollout.calculate_log_probs: true or false: rlsp's engine always")


def test_in_progress_keys_until_their_section_is_declared():
    # no feature is in progress now: sum_pi_squared_checkpointing has its answer (nothing to checkpoint)
    assert refusal("actor_rollout_ref.actor.sum_pi_squared_checkpointing").endswith("legal values: True, False")
    # reward.reward_kwargs is declared now: a key under it that the schema lacks is a plain unknown key
    assert refusal("reward.reward_kwargs.overlong_buffer_cfg.lenght") is None


def testprivate_ray_resources():
    import os  # noqa: PLC0415

    from rlsp.controller.ray_session import private_ray_resources  # noqa: PLC0415

    cfg = OmegaConf.structured(RLSPConfig)
    cfg.trainer.device = "cuda"
    assert private_ray_resources(cfg, 4) == {"num_cpus": max(os.cpu_count() or 1, 4), "object_store_memory": 512 * 1024**2}
    cfg.ray_kwargs.ray_init.num_cpus, cfg.ray_kwargs.ray_init.object_store_memory = 96, 2**30
    assert private_ray_resources(cfg, 8) == {"num_cpus": 96, "object_store_memory": 2**30}
    cfg.trainer.device = "cpu"
    with pytest.raises(RuntimeError, match="ray_kwargs.ray_init.num_cpus=96 on a CPU run"):
        private_ray_resources(cfg, 2)
