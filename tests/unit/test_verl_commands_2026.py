"""verl's algorithm-folder example commands (tests/data/verl_commands_2026.json) checked by `python -m rlsp.check`.

The scripts of verl's algorithm folders (cispo, gmpo, gpg, gspo, otb, reinforce++, remax, rloo, rollout
correction, sapo) that train a text model with FSDP and vLLM, expanded by scripts/extract_verl_commands.py
--2026, run through rlsp.check as written with only their model and data paths swapped for local ones (as
tests/unit/test_verl_commands.py does; enough training prompts for each command's run length) and
`--config-name verl`. Per command the test pins the exact set of refusals: each names a key of the command
(or rlsp's spelling of it) and says why; every other key is accepted. Keys and values of features still in
progress (rlsp.config.verl_compat NOT_YET_KEYS / NOT_YET_VALUES) count as accepted while undeclared.

A second test composes one command in newer verl's spellings (critic.fsdp.*, reward.reward_model.*,
ref.fsdp_config.ulysses_sequence_parallel_size, ...) and the same command in the older ones: both must give
the same config, and rlsp.check must accept it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from test_verl_commands import _problems, build_local, localize, spelled_as

from rlsp.check import main as check_main
from rlsp.config.compose import CommandLine, compose_collecting
from rlsp.config.validate_keys import schema_keys
from rlsp.config.verl_compat import NOT_YET_VALUES, apply_verl_spellings, in_progress

DATA = Path(__file__).resolve().parents[2] / "tests" / "data"
COMMANDS = json.loads((DATA / "verl_commands_2026.json").read_text())["commands"]
# script -> (key, words of the reason) of every refusal it must get; a command not listed must be accepted.
REFUSED: dict[str, list[tuple[str, str]]] = {
    "examples/gmpo_trainer/test_dapo_7b_math.sh": [("actor_rollout_ref.model.override_config.max_position_embeddings",
                                                    "overriding entries of the model's config.json is not supported")],
    "examples/sapo_trainer/run_qwen30b_sapo.sh": [("actor_rollout_ref.rollout.val_kwargs.do_sample",
                                                   "would have no effect"), ("algorithm.lam", "has no effect")],
}
MIN_ACCEPTED = len(COMMANDS) - len(REFUSED)


def _training_rows() -> int:
    """Enough training prompts for every command's run length (verl's data sets are larger than the samples):
    total_training_steps / total_epochs batches of train_batch_size per epoch, at least 4096."""
    rows = 4096
    for command in COMMANDS:
        values = dict(a.lstrip("+").partition("=")[::2] for a in command["args"])
        if "trainer.total_training_steps" in values:
            per_epoch = -(-int(values["trainer.total_training_steps"]) // int(values.get("trainer.total_epochs", 30)))
            rows = max(rows, per_epoch * int(values["data.train_batch_size"]))
    return rows


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> dict[str, str]:
    return build_local(tmp_path_factory.mktemp("verl2026"), _training_rows())


def _pending(problem: str, keys: list[str], declared: set[str]) -> bool:
    """A refusal of a feature another change is adding: an undeclared in-progress key, or its value."""
    if any(problem.startswith(f"{k} is not supported") for k in keys if k not in declared and in_progress(k)):
        return True
    return any(problem.startswith(f"{key}={value!r}") for key, value in NOT_YET_VALUES)


def _matches(problem: str, expected: tuple[str, str]) -> bool:
    return expected[0] in problem and expected[1] in problem


def test_every_2026_command_is_accepted_or_refused_by_name(local, capsys):
    declared = set(schema_keys())
    accepted, refused = [], {}
    for command in COMMANDS:
        rc = check_main(localize(command["args"], local))
        problems = _problems(capsys.readouterr().out)
        keys = [a.lstrip("+~").partition("=")[0] for a in command["args"]]
        assert (rc == 0) == (not problems), (command["script"], rc, problems)
        named = set(keys) | set(spelled_as(keys))
        for problem in problems:  # every refusal names a key of the command (or rlsp's spelling of it)
            assert any(k in problem for k in named), (command["script"], problem)
        rest = [p for p in problems if not _pending(p, keys, declared)]
        if rest:
            refused[command["script"]] = rest
        else:
            accepted.append(command["script"])
    for script, problems in refused.items():  # exactly the pinned refusals, one problem each
        expected = REFUSED.get(script, [])
        assert len(problems) == len(expected), (script, problems, expected)
        for want in expected:
            assert any(_matches(p, want) for p in problems), (script, want, problems)
    assert sorted(refused) == sorted(REFUSED), (sorted(refused), sorted(REFUSED))
    assert len(accepted) >= MIN_ACCEPTED, (accepted, refused)


# One PPO command with a reward model and the runtime keys of newer verl, in its two generations' spellings.
_COMMON = ["algorithm.adv_estimator=gae", "data.train_batch_size=64", "data.max_prompt_length=512",
           "data.max_response_length=512", "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.n=2",
           "actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
           "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "trainer.total_epochs=1",
           "actor_rollout_ref.rollout.calculate_log_probs=True", "actor_rollout_ref.rollout.enable_chunked_prefill=False",
           "actor_rollout_ref.rollout.max_num_batched_tokens=2048",
           "actor_rollout_ref.rollout.checkpoint_engine.backend=naive",
           "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=1024",
           "+actor_rollout_ref.rollout.engine_kwargs.vllm.disable_log_stats=false",
           "ray_kwargs.ray_init.num_cpus=64", "trainer.log_val_generations=4"]
NEWER = _COMMON + ["critic.fsdp.param_offload=True", "critic.fsdp.optimizer_offload=True",
                   "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size=2",
                   "actor_rollout_ref.ref.entropy_from_logits_with_chunking=True",
                   "actor_rollout_ref.actor.fsdp_config.entropy_checkpointing=True",
                   "reward.reward_model.enable=True", "reward.reward_model.model_path=REWARD_MODEL",
                   "reward.reward_model.rollout.gpu_memory_utilization=0.3", "reward.reward_manager.name=naive",
                   "actor_rollout_ref.actor.grad_clip=0.5"]
OLDER = _COMMON + ["critic.model.fsdp_config.param_offload=True", "critic.model.fsdp_config.optimizer_offload=True",
                   "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
                   "actor_rollout_ref.ref.entropy_from_logits_with_chunking=True",
                   "actor_rollout_ref.actor.entropy_checkpointing=True",
                   "reward_model.enable=True", "reward_model.model.path=REWARD_MODEL", "reward_model.use_reward_loop=True",
                   "reward_model.rollout.gpu_memory_utilization=0.3", "reward_model.reward_manager=naive",
                   "actor_rollout_ref.actor.optim.clip_grad=0.5"]


def _localized(args: list[str], local: dict[str, str]) -> list[str]:
    args = [a.replace("REWARD_MODEL", local["reward_model"]) for a in args]
    return localize(["data.train_files=x", "data.val_files=x", "actor_rollout_ref.model.path=x", *args], local)


def test_newer_and_older_spellings_compose_alike_and_are_accepted(local, capsys):
    configs = []
    for args in (NEWER, OLDER):
        line = _localized(args, local)
        cfg, problems = compose_collecting(CommandLine(config_name=line[1], overrides=line[2:]))
        assert problems == [] and cfg is not None, problems
        errors: list[str] = []
        apply_verl_spellings(cfg, errors)
        assert errors == []
        configs.append(OmegaConf.to_container(cfg, resolve=False))
    assert configs[0] == configs[1]
    cfg = configs[0]
    assert cfg["critic"]["model"]["fsdp_config"]["param_offload"] is True
    assert cfg["actor_rollout_ref"]["ref"]["ulysses_sequence_parallel_size"] == 2
    assert cfg["reward_model"]["model"]["path"] == local["reward_model"] and cfg["reward_model"]["use_reward_loop"]
    assert cfg["actor_rollout_ref"]["rollout"]["engine_kwargs"]["vllm"] == {"disable_log_stats": False}
    assert cfg["ray_kwargs"]["ray_init"]["num_cpus"] == 64
    rc = check_main(_localized(NEWER, local))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "critic.fsdp.param_offload: verl's other spelling of critic.model.fsdp_config.param_offload" in out
