"""Multi-turn keys: verl's agentic command shapes are accepted and explained by `python -m rlsp.check`; values
and combinations rlsp cannot run are refused before any worker has the run's config, each naming the key and what is legal."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from rlsp.check import run_checks
from rlsp.config.compose import compose_config
from rlsp.config.run_spec import agent_loops_enabled
from rlsp.config.validate import validate_config

DATA = Path(__file__).resolve().parents[1] / "data" / "agent_loops"
MT = "actor_rollout_ref.rollout.multi_turn."
AGENT = "actor_rollout_ref.rollout.agent."
VERL_AGENTIC = [  # the multi-turn part of a verl tool-agent command
    f"{MT}enable=true", f"{MT}format=hermes", f"{MT}max_assistant_turns=3", f"{MT}max_user_turns=3",
    f"{MT}max_parallel_calls=1", f"{MT}max_tool_response_length=64", f"{MT}tool_response_truncate_side=right",
    f"{MT}tool_config_path={DATA / 'tools.yaml'}", f"{MT}tokenization_sanity_check_mode=ignore_strippable",
    f"{MT}use_inference_chat_template=true", f"{AGENT}default_agent_loop=tool_agent", f"{AGENT}num_workers=4",
    "actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true",
]


def _errors(*overrides: str) -> str:
    with pytest.raises(ValueError) as err:
        validate_config(compose_config(overrides=list(overrides)))
    return str(err.value)


def test_verl_agentic_command_is_checked_and_explained(tmp_path) -> None:
    report = run_checks([*VERL_AGENTIC, f"trainer.default_local_dir={tmp_path / 'run'}"])
    assert report.problems == [], report.render()
    agent = "\n".join(report.sections["agent"])
    assert "train rows per loop: tool_agent: " in agent
    assert "tools: calculator (chat template does NOT render their schemas)" in agent  # the tiny model's template
    assert "turns: assistant 3, tool 3; each turn up to what is left of the budget" in agent
    assert "hermes format, 1 per turn, 30 s each, responses cut to 64 characters (right)" in agent
    verl = "\n".join(report.sections["verl keys"])
    assert f"{MT}tokenization_sanity_check_mode: verl's meaning" in verl and f"{AGENT}num_workers: verl's meaning" in verl


def test_broken_tool_file_and_unknown_loop_names_are_problems(tmp_path) -> None:
    (tmp_path / "tools.yaml").write_text("tools:\n  - class_name: no_such_module.Tool\n    tool_schema: "
                                         "{type: function, function: {name: t}}\n")
    report = run_checks([f"{MT}enable=true", f"{MT}tool_config_path={tmp_path / 'tools.yaml'}",
                         f"{AGENT}default_agent_loop=mystery_loop", f"trainer.default_local_dir={tmp_path / 'run'}"])
    text = "\n".join(report.problems)
    assert f"{MT}tool_config_path={tmp_path / 'tools.yaml'}" in text and "no_such_module" in text
    assert f"{AGENT}default_agent_loop: agent loop 'mystery_loop' is not registered; registered: [" in text


def test_agent_name_column_is_checked(tmp_path) -> None:
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "data_source": "rlsp/arithmetic",
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
             "agent_name": "mystery_agent" if i == 3 else "tool_agent", "extra_info": {"index": i}} for i in range(32)]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    report = run_checks([f"{MT}enable=true", f"data.train_files={tmp_path / 'train.parquet'}", "data.val_files=null",
                         f"trainer.default_local_dir={tmp_path / 'run'}"])
    assert any("column agent_name: agent loop 'mystery_agent' is not registered" in p for p in report.problems), \
        report.render()
    assert "train rows per loop: mystery_agent: 1, tool_agent: 31" in "\n".join(report.sections["agent"])


@pytest.mark.parametrize("overrides,message", [
    ([f"{MT}tool_config_path=t.yaml"], f"{MT}tool_config_path='t.yaml' has no effect without agent loops"),
    ([f"{MT}enable=true", f"{MT}max_tokens_per_turn=99"], "max_tokens_per_turn=99 exceeds data.max_response_length=8"),
    ([f"{MT}enable=true", "actor_rollout_ref.rollout.ignore_eos=true"], "an assistant turn would never end"),
    ([f"{MT}enable=true", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
     "agent loops batch their turns as tools finish; legal: tensor_model_parallel_size=1"),
    ([f"{MT}max_assistant_turns=0"], f"{MT}max_assistant_turns=0 must be an integer >= 1 or null (no limit)"),
    ([f"{MT}tool_timeout_s=0"], f"{MT}tool_timeout_s=0.0 must be a positive number"),
    ([f"{MT}tokenization_sanity_check_mode=loose"], "legal values: ['strict', 'ignore_strippable', 'disable']"),
    ([f"{AGENT}num_workers=0"], f"{AGENT}num_workers=0 must be an integer >= 1"),
])
def test_refusals_name_the_key_and_what_is_legal(overrides, message) -> None:
    assert message in _errors(*overrides)


def test_agent_loops_run_for_verl_agent_commands_without_enable() -> None:
    assert not agent_loops_enabled(compose_config())
    assert agent_loops_enabled(compose_config(overrides=[f"{MT}enable=true"]))
    assert agent_loops_enabled(compose_config(overrides=[f"{AGENT}default_agent_loop=tool_agent"]))
    assert agent_loops_enabled(compose_config(overrides=[f"{AGENT}agent_loop_config_path=loops.yaml"]))
