"""verl 0.9's Ray start-up and worker keys in rlsp: ray_kwargs.ray_init.runtime_env (env_vars, py_executable),
actor_rollout_ref.nccl_timeout, reward.num_workers, rollout.multi_stage_wake_up (the vLLM engine's staged wake-up,
driven here through a fake `vllm.LLM` recording its calls: the GPU path cannot run on CPU) and
rollout.engine_kwargs.sglang/trtllm beside a vLLM or hf engine.
e2e: tests/e2e/test_ray_runtime_env.py (env_vars and the launcher in the workers); tests/distributed/
test_group_timeout.py (the timeout in every process group)."""

from __future__ import annotations

import sys

import pytest
from omegaconf import OmegaConf

from rlsp.config.compose import CommandLine, compose_collecting
from rlsp.config.schema import RLSPConfig
from rlsp.config.validate_verl_runtime import check_verl_runtime_keys
from rlsp.config.verl_compat import refusal, verl_key_notes, verl_status
from rlsp.config.verl_spellings import rlsp_key
from rlsp.controller.ray_session import job_runtime_env, launcher_problem
from rlsp.controller.worker_pools import worker_env
from rlsp.rollout.vllm_engine import SLEEP_TAGS, VLLMEngine

RUNTIME_ENV = "ray_kwargs.ray_init.runtime_env"


def _compose(*overrides: str):
    cfg, problems = compose_collecting(CommandLine("verl", list(overrides)))
    return cfg, problems


def _errors(cfg) -> list[str]:
    errors: list[str] = []
    check_verl_runtime_keys(cfg, errors)
    return errors


def test_verl_0_9_command_keys_compose_and_pass():
    cfg, problems = _compose(f"{RUNTIME_ENV}.py_executable=null", f"+{RUNTIME_ENV}.env_vars.TRANSFER_QUEUE_ENABLE=1",
                             "actor_rollout_ref.nccl_timeout=7200", "reward.num_workers=3",
                             "actor_rollout_ref.rollout.multi_stage_wake_up=True",
                             "actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=triton",
                             "+actor_rollout_ref.rollout.engine_kwargs.trtllm.batch_wait_timeout_iters=32")
    assert problems == []
    assert _errors(cfg) == []
    assert cfg.ray_kwargs.ray_init.runtime_env.py_executable is None
    assert dict(cfg.ray_kwargs.ray_init.runtime_env.env_vars) == {"TRANSFER_QUEUE_ENABLE": "1"}
    assert cfg.actor_rollout_ref.nccl_timeout == 7200
    assert cfg.reward_model.num_workers == 3  # verl 0.9's reward-loop workers: rlsp's rule scoring processes
    assert cfg.actor_rollout_ref.rollout.multi_stage_wake_up is True
    assert dict(cfg.actor_rollout_ref.rollout.engine_kwargs.sglang) == {"attention_backend": "triton"}


def test_notes_said_at_start_up():
    notes = verl_key_notes([f"{RUNTIME_ENV}.py_executable=null", "actor_rollout_ref.rollout.multi_stage_wake_up=True",
                            "actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=triton",
                            "actor_rollout_ref.rollout.engine_kwargs.trtllm.x=1", "reward.num_workers=8",
                            "actor_rollout_ref.nccl_timeout=600", f"+{RUNTIME_ENV}.env_vars.A=1"])
    assert len(notes) == 7, notes
    by_key = dict(n.split(": ", 1) for n in notes)
    assert "no effect on CPU" in by_key["actor_rollout_ref.rollout.multi_stage_wake_up"]
    assert by_key["actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend"].startswith(
        "engine not in use: ignored")
    assert by_key["actor_rollout_ref.rollout.engine_kwargs.trtllm.x"].startswith("engine not in use: ignored")
    assert by_key["reward.num_workers"].startswith("verl's other spelling of reward_model.num_workers")
    assert rlsp_key("reward.num_workers") == "reward_model.num_workers"
    assert verl_status(f"{RUNTIME_ENV}.env_vars.TRANSFER_QUEUE_ENABLE", set()).startswith(
        "accepted: set in every Ray process of the run")
    assert refusal(f"{RUNTIME_ENV}.env_vars.TRANSFER_QUEUE_ENABLE") is None


def test_sglang_as_the_engine_stays_refused():
    cfg, problems = _compose("actor_rollout_ref.rollout.name=sglang")
    assert problems == []
    from rlsp.config.validate_core import check_choices  # noqa: PLC0415

    errors: list[str] = []
    check_choices(cfg, errors)
    assert any("actor_rollout_ref.rollout.name='sglang' is not supported" in e for e in errors), errors


@pytest.mark.parametrize(("override", "words"), [
    (f"+{RUNTIME_ENV}.env_vars.RANK=3", "env_vars.RANK='3' is not supported: rlsp sets RANK in every worker"),
    (f"+{RUNTIME_ENV}.env_vars.VLLM_ENABLE_V1_MULTIPROCESSING=1", "vLLM runs in the worker's own process"),
    (f"{RUNTIME_ENV}.py_executable=''", "py_executable='' is empty: legal values: null (this Python) or a command"),
    ("actor_rollout_ref.nccl_timeout=0", "actor_rollout_ref.nccl_timeout=0 must be an integer >= 1"),
])
def test_refused_values(override, words):
    cfg, problems = _compose(override)
    assert problems == []
    errors = _errors(cfg)
    assert len(errors) == 1 and words in errors[0], errors


def test_cpu_thread_variables_refused_on_cpu_only():
    cfg, _ = _compose(f"+{RUNTIME_ENV}.env_vars.OMP_NUM_THREADS=4", "trainer.device=cpu")
    assert "on CPU each worker binds its own share of the cores" in _errors(cfg)[0]
    cfg.trainer.device = "cuda"
    assert _errors(cfg) == []


def test_other_runtime_env_fields_and_ray_init_arguments_refused_by_name():
    _, problems = _compose(f"+{RUNTIME_ENV}.working_dir=/src", "+ray_kwargs.ray_init.num_gpus=8")
    assert problems[0].startswith(f"{RUNTIME_ENV}.working_dir is not supported: of Ray's runtime_env rlsp passes "
                                  "env_vars and py_executable")
    assert problems[1].startswith("ray_kwargs.ray_init.num_gpus is not supported: rlsp starts its private Ray with "
                                  "num_cpus, object_store_memory and runtime_env")


def test_the_jobs_runtime_env_and_the_workers_environment():
    cfg = OmegaConf.structured(RLSPConfig)
    assert job_runtime_env(cfg) == {}
    cfg.ray_kwargs.ray_init.runtime_env.env_vars = {"A": "1", "VLLM_LOGGING_LEVEL": "DEBUG"}
    cfg.ray_kwargs.ray_init.runtime_env.py_executable = "uv run --frozen"
    assert job_runtime_env(cfg) == {"env_vars": {"A": "1", "VLLM_LOGGING_LEVEL": "DEBUG"},
                                    "py_executable": "uv run --frozen"}
    env = worker_env(cfg)
    assert env["A"] == "1" and env["VLLM_LOGGING_LEVEL"] == "DEBUG"  # the user's value over rlsp's default


def test_launcher_must_exist_for_a_private_ray(monkeypatch):
    cfg = OmegaConf.structured(RLSPConfig)
    assert launcher_problem(cfg) is None  # null: this Python
    cfg.ray_kwargs.ray_init.runtime_env.py_executable = "rlsp-no-such-launcher run --frozen"
    assert launcher_problem(cfg) == (
        f"{RUNTIME_ENV}.py_executable='rlsp-no-such-launcher run --frozen': 'rlsp-no-such-launcher' is not a program "
        "on this PATH, so the private Ray could not start any worker process through it; install it, give its full "
        "path, or leave py_executable null (the workers run this Python)")
    cfg.ray_kwargs.ray_init.runtime_env.py_executable = f"{sys.executable} -X importtime"
    assert launcher_problem(cfg) is None
    cfg.ray_kwargs.ray_init.runtime_env.py_executable = "/nonexistent/bin/python"
    assert "'/nonexistent/bin/python' is not an executable file" in launcher_problem(cfg)
    cfg.trainer.ray_address = "10.0.0.1:6379"  # a cluster's nodes are not this machine
    assert launcher_problem(cfg) is None


class FakeLLM:
    """Records what the engine asks of vLLM's sleep mode and weight loading."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list | None:
        if callable(method):  # a function run on the worker (the CPU MoE expert checksums): a dense model has none
            self.calls.append(("collective_rpc", method.__name__))
            return [{}]
        self.calls.append(("collective_rpc", method, [name for name, _ in kwargs["weights_iterator"]]))
        return None

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))


def _engine(multi_stage: bool, on_gpu: bool = True) -> tuple[VLLMEngine, list]:
    engine = VLLMEngine.__new__(VLLMEngine)  # no vllm.LLM: the GPU path is driven through the fake
    calls: list = []
    engine.llm, engine.on_gpu, engine.multi_stage_wake_up = FakeLLM(calls), on_gpu, multi_stage
    engine.tie_word_embeddings, engine.model_type, engine._asleep = False, "qwen2", ()
    engine.checkpoint_names = None  # a dense model: the trainer's names are vLLM's
    return engine, calls


def test_multi_stage_wake_up_loads_weights_before_the_kv_cache_wakes():
    engine, calls = _engine(multi_stage=True)
    engine.sleep()
    engine.update_weights([("w", object())])
    engine.wake_up()  # generation: already awake, nothing to do
    assert calls == [("sleep", 1), ("wake_up", ["weights"]), ("collective_rpc", "reload_weights", ["w"]),
                     ("wake_up", ["kv_cache"]), ("reset_prefix_cache",)]
    assert engine._asleep == ()


def test_single_stage_wakes_everything_before_loading():
    engine, calls = _engine(multi_stage=False)
    engine.sleep()
    engine.update_weights([("w", object())])
    assert calls == [("sleep", 1), ("wake_up", None), ("collective_rpc", "reload_weights", ["w"]),
                     ("reset_prefix_cache",)]


def test_sleep_when_half_awake_maps_the_rest_first():
    engine, calls = _engine(multi_stage=True)
    engine.sleep()
    engine.wake_up(("weights",))
    engine.sleep()  # vLLM's sleep releases every tag: the KV cache is woken before it
    assert calls == [("sleep", 1), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"]), ("sleep", 1)]
    assert engine._asleep == SLEEP_TAGS


def test_cpu_engine_has_no_sleep_mode():
    engine, calls = _engine(multi_stage=True, on_gpu=False)
    engine.sleep()
    engine.update_weights([("w", object())])
    assert calls == [("collective_rpc", "_cpu_expert_checksums"), ("collective_rpc", "reload_weights", ["w"]),
                     ("reset_prefix_cache",)]


def test_rollout_role_leaves_the_waking_to_the_vllm_engine():
    from rlsp.workers.roles.rollout import RolloutRole  # noqa: PLC0415

    role = RolloutRole.__new__(RolloutRole)
    role.cfg = OmegaConf.structured(RLSPConfig)
    role.cfg.actor_rollout_ref.rollout.name = "vllm"
    role.engine, calls = _engine(multi_stage=True)
    role.sleep()
    role.load_weights([("w", object())])
    assert [c[0] for c in calls] == ["sleep", "wake_up", "collective_rpc", "wake_up", "reset_prefix_cache"]
    assert calls[1] == ("wake_up", ["weights"])
