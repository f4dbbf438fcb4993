"""A model directory that cannot be loaded is named before any worker has the run's config, by rlsp.check and by
rlsp.main's preflight alike: one line per problem with the key, the path and what is missing.

* a model directory without config.json (an empty one too), or whose model_type transformers does not know
  (the actor, the critic, the reward model); an actor directory without tokenizer files;
* a reward model without tokenizer files (transformers would build an empty tokenizer in its place),
  for the legacy reward-model worker and the reward loop;
* a LoRA adapter directory without adapter weights.

rlsp.check exits 2 listing the problem; rlsp.main exits 2 on the ValueError of `validate_config`
(the LoRA keys) or `preflight` (the model files) before any worker has the run's config. Each actor case
also with multi-turn rollouts on: the agent check reads the tokenizer, and runs only once the model
directory and the tokenizer checks passed (one line, never a traceback from transformers).
"""

from __future__ import annotations

import json
import os
import shutil

import pandas as pd
import pytest

from rlsp import main as rlsp_main
from rlsp.check import main as check_main
from rlsp.checks.preflight import preflight
from rlsp.config.compose import compose_config, parse_command_line
from rlsp.config.validate import validate_config
from rlsp.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_reward_model

ADAPTER_KEY = "actor_rollout_ref.model.lora_adapter_path"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    """A good tiny policy and reward model, and broken copies of them."""
    root = tmp_path_factory.mktemp("models")
    good = build_tiny_model(TinyModelSpec(), str(root / "good"))
    rm = build_tiny_reward_model(TinyModelSpec(), str(root / "rm"))
    out = {"good": good, "rm": rm}
    for name in ("no_config", "bad_type"):
        out[name] = shutil.copytree(good, str(root / name))
    os.remove(os.path.join(out["no_config"], "config.json"))
    out["empty"] = str(root / "empty")
    os.mkdir(out["empty"])
    out["no_tokenizer"] = shutil.copytree(good, str(root / "no_tokenizer"),
                                          ignore=shutil.ignore_patterns("tokenizer*", "chat_template*", "vocab*",
                                                                        "special_tokens*"))
    config_file = os.path.join(out["bad_type"], "config.json")
    with open(config_file) as f:
        config = json.load(f)
    with open(config_file, "w") as f:
        json.dump({**config, "model_type": "qwen99"}, f)
    out["rm_no_tokenizer"] = shutil.copytree(rm, str(root / "rm_no_tokenizer"),
                                             ignore=shutil.ignore_patterns("tokenizer*", "chat_template*"))
    adapter = root / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                                             "target_modules": ["q_proj", "v_proj"]}))
    out["adapter"] = str(adapter)
    rows = [{"data_source": "rlsp/arithmetic", "prompt": [{"role": "user", "content": "1+1"}],
             "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": i}} for i in range(4)]
    out["train"] = str(root / "train.parquet")
    pd.DataFrame(rows).to_parquet(out["train"])
    return out


def _argv(tmp_path, dirs, *overrides: str) -> list[str]:
    return ["trainer.device=cpu", f"trainer.cache_dir={tmp_path / 'cache'}", f"trainer.default_local_dir={tmp_path / 'run'}",
            f"data.train_files={dirs['train']}", "data.val_files=null", "data.train_batch_size=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.total_training_steps=2",
            f"actor_rollout_ref.model.path={dirs['good']}", *overrides]


def _check(argv: list[str], capsys) -> tuple[int, list[str]]:
    """rlsp.check's exit code and the problems it lists."""
    rc = check_main(argv)
    out = capsys.readouterr().out
    return rc, [line[4:] for line in out.splitlines() if line.startswith("  - ")]


def _preflight_error(argv: list[str]) -> list[str]:
    """The problems rlsp.main's preflight refuses the command with (it then exits 2)."""
    line = parse_command_line(argv)
    with pytest.raises(ValueError) as info:
        preflight(compose_config(line.config_name, line.overrides))
    return [p for p in str(info.value).split("\n  - ")[1:]]


def _main_error(argv: list[str], capsys) -> list[str]:
    """rlsp.main's own refusal: its checks before Ray's workers get the config exit 2 with one line a problem."""
    line = parse_command_line(argv)
    cfg = compose_config(line.config_name, line.overrides)
    layout = rlsp_main.validate_config(cfg)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        rlsp_main._prepare_checked(cfg, layout)
    assert info.value.code == 2
    return [ln[4:] for ln in capsys.readouterr().err.splitlines() if ln.startswith("  - ")]


CASES = {
    # name: (config, overrides(dirs), needle(dirs))
    "actor in an empty directory": (
        "rlsp", lambda d: [f"actor_rollout_ref.model.path={d['empty']}"],
        lambda d: f"actor_rollout_ref.model.path={d['empty']!r} has no config.json"),
    "actor without tokenizer files": (
        "rlsp", lambda d: [f"actor_rollout_ref.model.path={d['no_tokenizer']}"],
        lambda d: f"actor_rollout_ref.model.path={d['no_tokenizer']!r} has no tokenizer (none of tokenizer.json"),
    "actor without config.json": (
        "rlsp", lambda d: [f"actor_rollout_ref.model.path={d['no_config']}"],
        lambda d: f"actor_rollout_ref.model.path={d['no_config']!r} has no config.json"),
    "actor of an unknown model_type": (
        "rlsp", lambda d: [f"actor_rollout_ref.model.path={d['bad_type']}"],
        lambda d: f"actor_rollout_ref.model.path={d['bad_type']!r}: its config.json has model_type='qwen99', which "
                  "transformers "),
    "critic without config.json": (
        "ppo", lambda d: [f"critic.model.path={d['no_config']}"],
        lambda d: f"critic.model.path={d['no_config']!r} has no config.json"),
    "reward model without config.json": (
        "rlsp", lambda d: ["reward_model.enable=true", f"reward_model.model.path={d['no_config']}"],
        lambda d: f"reward_model.model.path={d['no_config']!r} has no config.json"),
    "reward model without a tokenizer": (
        "rlsp", lambda d: ["reward_model.enable=true", f"reward_model.model.path={d['rm_no_tokenizer']}"],
        lambda d: f"reward_model.model.path={d['rm_no_tokenizer']!r} has no tokenizer (none of tokenizer.json"),
    "reward loop's model without a tokenizer": (
        "rlsp", lambda d: ["reward_model.enable=true", "reward_model.use_reward_loop=true",
                           f"reward_model.model.path={d['rm_no_tokenizer']}"],
        lambda d: f"reward_model.model.path={d['rm_no_tokenizer']!r} has no tokenizer (none of tokenizer.json"),
}


MULTI_TURN = "actor_rollout_ref.rollout.multi_turn.enable=true"
ACTOR_CASES = [c for c in CASES if c.startswith("actor")]


def _case_argv(case: str, dirs, tmp_path, multi_turn: bool) -> list[str]:
    config, overrides, _ = CASES[case]
    return ["--config-name", config, *_argv(tmp_path, dirs, *overrides(dirs), *([MULTI_TURN] if multi_turn else []))]


# every case with the default config; the actor's (whose tokenizer multi-turn reads) with multi-turn on too
CHECK_CASES = [(c, False) for c in CASES] + [(c, True) for c in ACTOR_CASES]


@pytest.mark.parametrize(("case", "multi_turn"), CHECK_CASES, ids=[f"{c}-{'multi_turn' if m else 'default'}"
                                                                   for c, m in CHECK_CASES])
def test_rlsp_check_names_the_bad_model_dir(case, multi_turn, dirs, tmp_path, capsys):
    rc, problems = _check(_case_argv(case, dirs, tmp_path, multi_turn), capsys)
    assert rc == 2
    assert len(problems) == 1 and problems[0].startswith(CASES[case][2](dirs)), problems


@pytest.mark.parametrize("case", list(CASES))
def test_preflight_names_the_bad_model_dir(case, dirs, tmp_path):
    problems = _preflight_error(_case_argv(case, dirs, tmp_path, False))
    assert len(problems) == 1 and problems[0].startswith(CASES[case][2](dirs)), problems


@pytest.mark.parametrize("multi_turn", [False, True], ids=["default", "multi_turn"])
@pytest.mark.parametrize("case", ACTOR_CASES)
def test_rlsp_main_names_the_bad_actor_dir(case, multi_turn, dirs, tmp_path, capsys):
    problems = _main_error(_case_argv(case, dirs, tmp_path, multi_turn), capsys)
    assert len(problems) == 1 and problems[0].startswith(CASES[case][2](dirs)), problems


def test_checks_of_features_not_in_use_load_nothing(dirs, tmp_path, monkeypatch):
    """No agent loops, teachers or reward model: nothing loads a tokenizer during the checks."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a check of a feature not in use loaded a tokenizer")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    line = parse_command_line(_argv(tmp_path, dirs))
    preflight(compose_config(line.config_name, line.overrides))  # passes without loading one


def test_unknown_model_type_says_transformers_does_not_know_it(dirs, tmp_path):
    (problem,) = _preflight_error(_argv(tmp_path, dirs, f"actor_rollout_ref.model.path={dirs['bad_type']}"))
    assert "does not know" in problem and "model_type='qwen99'" in problem


def test_lora_adapter_without_weights(dirs, tmp_path, capsys):
    lora = [f"{ADAPTER_KEY}={dirs['adapter']}", "actor_rollout_ref.model.lora_rank=8"]
    needle = (f"{ADAPTER_KEY}={dirs['adapter']!r} has adapter_config.json but no adapter weights "
              "(adapter_model.safetensors or adapter_model.bin)")
    rc, problems = _check(_argv(tmp_path, dirs, *lora), capsys)
    assert rc == 2 and len(problems) == 1 and problems[0].startswith(needle), problems
    line = parse_command_line(_argv(tmp_path, dirs, *lora))
    with pytest.raises(ValueError) as info:  # rlsp.main: validate_config, before anything starts
        validate_config(compose_config(line.config_name, line.overrides))
    assert needle in str(info.value)
    with open(os.path.join(dirs["adapter"], "adapter_model.safetensors"), "wb"):
        pass  # present: the directory is accepted (its contents are read by the workers)
    rc, problems = _check(_argv(tmp_path, dirs, *lora), capsys)
    assert not any(ADAPTER_KEY in p for p in problems), problems
    os.remove(os.path.join(dirs["adapter"], "adapter_model.safetensors"))


def test_good_dirs_pass(dirs, tmp_path, capsys):
    rc, problems = _check(_argv(tmp_path, dirs, "reward_model.enable=true", f"reward_model.model.path={dirs['rm']}"),
                          capsys)
    assert (rc, problems) == (0, [])
