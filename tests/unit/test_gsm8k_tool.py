"""verl's GSM8K multi-turn tool example on rlsp: `Gsm8kTool` on hand-built calls, verl's tool YAML (with verl's
class name) loading rlsp's tool, a ToolSession driven by a preprocessed row's tools_kwargs, and verl's
multi-turn GRPO command shape checked by `rlsp.check` against `gsm8k_multiturn` parquet and a tiny model."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

from rlsp.agent.tools.gsm8k import GSM8K_TOOL_SCHEMA, TOOL_NAME, Gsm8kTool, as_submission
from rlsp.agent.tools.loading import TOOL_CONFIG_KEY, VERL_TOOL_CLASSES, load_tool_config, load_tools
from rlsp.agent.tools.session import ToolSession
from rlsp.agent.types import ToolCall
from rlsp.check import run_checks
from rlsp.data.preprocess import preprocess
from rlsp.models.tiny import TinyModelSpec, ensure_tiny_model

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
VERL_TOOL_YAML = DATA / "verl_gsm8k_tool_config.yaml"
A = "actor_rollout_ref."


def submit(tool: Gsm8kTool, instance_id: str, answer: Any) -> tuple[str, float]:
    response, step_reward, metrics = asyncio.run(tool.execute(instance_id, {"answer": answer}))
    assert metrics == {}
    return response.text, step_reward


def score(tool: Gsm8kTool, instance_id: str) -> float:
    return asyncio.run(tool.calc_reward(instance_id))


def test_correct_answer_with_or_without_the_marker_scores_one() -> None:
    tool = Gsm8kTool()
    plain, _ = asyncio.run(tool.create(ground_truth="72"))
    assert score(tool, plain) == 0.0  # nothing submitted yet
    assert submit(tool, plain, "72") == ("Parsed answer: 72; reward: 1.0", 0.0)
    assert score(tool, plain) == 1.0 and tool.state(plain)["response"] == "#### 72"
    marked, _ = asyncio.run(tool.create(ground_truth="72"))
    assert submit(tool, marked, "#### 72") == ("Parsed answer: 72; reward: 1.0", 0.0)
    assert score(tool, marked) == 1.0 and tool.state(marked)["response"] == "#### 72"  # no second marker
    numeric, _ = asyncio.run(tool.create(ground_truth=72))  # any type becomes text
    assert submit(tool, numeric, 72) == ("Parsed answer: 72; reward: 1.0", 0.0)
    assert submit(tool, numeric, "$1,072.00")[0] == "Parsed answer: 1072; reward: 0.0"


def test_wrong_answers_and_resubmissions_are_penalised() -> None:
    tool = Gsm8kTool()
    instance, _ = asyncio.run(tool.create(ground_truth="72"))
    # The best score starts at 0.0: a wrong first answer does not improve on it.
    assert submit(tool, instance, "70") == ("Parsed answer: 70; reward: 0.0", -0.05)
    assert score(tool, instance) == 0.0
    assert submit(tool, instance, "70") == ("Parsed answer: 70; reward: 0.0", -0.05)
    assert submit(tool, instance, "no idea") == ("Parsed answer: (no number found); reward: 0.0", -0.05)
    assert submit(tool, instance, "72") == ("Parsed answer: 72; reward: 1.0", 0.0)  # improved
    assert submit(tool, instance, "72") == ("Parsed answer: 72; reward: 1.0", -0.05)  # same again
    assert submit(tool, instance, "71") == ("Parsed answer: 71; reward: 0.0", -0.05)
    assert score(tool, instance) == 0.0  # calc_reward is the latest submission's score
    asyncio.run(tool.release(instance))
    with pytest.raises(RuntimeError, match="no live instance"):
        score(tool, instance)


def test_both_create_forms_and_the_missing_ground_truth() -> None:
    tool = Gsm8kTool({"type": "native", "resubmit_penalty": -0.5})
    verl_form, _ = asyncio.run(tool.create("traj-1", create_kwargs={"ground_truth": "18"}))
    rlsp_form, _ = asyncio.run(tool.create(**{"ground_truth": "18"}))  # how ToolSession calls it
    assert verl_form == "traj-1" and rlsp_form != verl_form
    for instance in (verl_form, rlsp_form):
        assert submit(tool, instance, "18") == ("Parsed answer: 18; reward: 1.0", 0.0)
        assert submit(tool, instance, "18")[1] == -0.5
    with pytest.raises(ValueError, match="needs the problem's answer: pass ground_truth=... or create_kwargs="):
        asyncio.run(tool.create())
    with pytest.raises(ValueError, match="create_kwargs must be a mapping"):
        asyncio.run(tool.create(create_kwargs="18"))
    with pytest.raises(ValueError, match="resubmit_penalty='x': must be a number"):
        Gsm8kTool({"resubmit_penalty": "x"})
    assert as_submission(" ####5") == " ####5" and as_submission(None) == "#### None"
    assert Gsm8kTool().get_openai_tool_schema() == GSM8K_TOOL_SCHEMA and Gsm8kTool().name == TOOL_NAME


def test_verl_tool_yaml_loads_rlsp_gsm8k_tool() -> None:
    assert set(VERL_TOOL_CLASSES) == {"verl.tools.gsm8k_tool.Gsm8kTool", "verl.workers.tool.gsm8k_tool.Gsm8kTool"}
    tools = load_tools(str(VERL_TOOL_YAML), None)
    assert list(tools) == ["calc_gsm8k_reward"] and type(tools["calc_gsm8k_reward"]) is Gsm8kTool
    entry = yaml.safe_load(VERL_TOOL_YAML.read_text())["tools"][0]
    assert entry["class_name"] == "verl.tools.gsm8k_tool.Gsm8kTool"
    assert tools["calc_gsm8k_reward"].get_openai_tool_schema() == entry["tool_schema"]  # the YAML's, not the default
    assert tools["calc_gsm8k_reward"].config == {"type": "native"}


def test_the_class_mapping_is_logged() -> None:
    # A fresh process: the line is logged once per process, on rlsp's own terminal handler.
    code = f"from rlsp.agent.tools.loading import load_tools; load_tools({str(VERL_TOOL_YAML)!r}, None)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert ("tool class_name verl.tools.gsm8k_tool.Gsm8kTool is verl's built-in tool: using rlsp's "
            "rlsp.agent.tools.gsm8k.Gsm8kTool") in proc.stderr


def test_older_verl_class_name_and_unknown_verl_tools(tmp_path) -> None:
    entry = yaml.safe_load(VERL_TOOL_YAML.read_text())["tools"][0]
    older = tmp_path / "older.yaml"
    older.write_text(yaml.safe_dump({"tools": [{**entry, "class_name": "verl.workers.tool.gsm8k_tool.Gsm8kTool"}]}))
    assert [type(t) for t in load_tool_config(str(older))] == [Gsm8kTool]
    search = tmp_path / "search.yaml"
    search.write_text(yaml.safe_dump({"tools": [{**entry, "class_name": "verl.tools.search_tool.SearchTool"}]}))
    with pytest.raises(ValueError) as err:
        load_tool_config(str(search))
    message = str(err.value)
    assert message.startswith(f"{TOOL_CONFIG_KEY}={search}: tools[0]: class_name "
                              "'verl.tools.search_tool.SearchTool' names a verl tool that is not built into rlsp")
    assert "verl.tools.gsm8k_tool.Gsm8kTool" in message
    assert "point class_name at your own rlsp.agent.tools.base.BaseTool subclass" in message


def test_session_runs_the_tool_from_a_preprocessed_row(tmp_path) -> None:
    frame = pd.read_parquet(preprocess("gsm8k_multiturn", str(DATA / "gsm8k_sample.jsonl"), str(tmp_path)))
    extra = frame.iloc[2]["extra_info"]  # "#### 1,500": the ground truth is "1500"
    tools = load_tools(str(VERL_TOOL_YAML), None)
    session = ToolSession(tools, extra["tools_kwargs"], timeout_s=5.0, max_response_chars=256,
                          truncate_side="middle", max_parallel_calls=1)
    first, = asyncio.run(session.call([ToolCall(TOOL_NAME, {"answer": "1,498"})]))
    second, = asyncio.run(session.call([ToolCall(TOOL_NAME, {"answer": 1500})]))
    assert (first.text, first.reward, first.error) == ("Parsed answer: 1498; reward: 0.0", -0.05, None)
    assert (second.text, second.reward, second.error) == ("Parsed answer: 1500; reward: 1.0", 0.0, None)
    assert asyncio.run(session.close()) == 1.0  # calc_reward of the one instance, then released
    assert tools[TOOL_NAME]._instances == {}


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> dict[str, str]:
    """verl's multi-turn data (256 train rows: the command's train_batch_size; 20 val rows) and a tiny model
    with a long position range (1024 + 1024 tokens)."""
    tmp = tmp_path_factory.mktemp("gsm8k_multiturn")
    lines = (DATA / "gsm8k_sample.jsonl").read_text().splitlines()
    records = [json.loads(lines[i % len(lines)]) for i in range(256)]
    for i, record in enumerate(records):
        record["question"] += f" (#{i})"
    source = tmp / "train.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    return {"train": preprocess("gsm8k_multiturn", str(source), str(tmp / "data"), "train"),
            "val": preprocess("gsm8k_multiturn", str(DATA / "gsm8k_sample.jsonl"), str(tmp / "data"), "test"),
            "model": ensure_tiny_model(str(tmp / "model"), TinyModelSpec(max_position_embeddings=16384)),
            "run": str(tmp / "run"), "cache": str(tmp / "cache")}


def verl_multiturn_command(local: dict[str, str], engine: str) -> list[str]:
    """verl's run_qwen2.5-3b_gsm8k_multiturn.sh with gsm8k_multiturn_grpo.yaml's keys (multi_turn.enable,
    max_assistant_turns=5), paths swapped for local ones and rollout.name=`engine` (verl: sglang). Changed:
    rollout.tensor_model_parallel_size 2 -> 1 (rlsp's agent loops need 1; 2 is refused, see below) and
    trainer.logger without wandb; the batch sizes are verl's (256 prompts x n=16, micro-batches of 40)."""
    return [
        "--config-name", "verl", "algorithm.adv_estimator=grpo", "data.train_batch_size=256",
        "data.max_prompt_length=1024", "data.max_response_length=1024", "data.filter_overlong_prompts=True",
        "data.truncation=error", "data.return_raw_chat=True", f"{A}model.path={local['model']}",
        f"{A}actor.optim.lr=1e-6", f"{A}model.use_remove_padding=True", f"{A}actor.ppo_mini_batch_size=256",
        f"{A}actor.ppo_micro_batch_size_per_gpu=40", f"{A}actor.use_kl_loss=True", f"{A}actor.kl_loss_coef=0.001",
        f"{A}actor.kl_loss_type=low_var_kl", f"{A}actor.entropy_coeff=0",
        f"{A}model.enable_gradient_checkpointing=True",
        f"{A}actor.fsdp_config.param_offload=False", f"{A}actor.fsdp_config.optimizer_offload=False",
        f"{A}rollout.log_prob_micro_batch_size_per_gpu=40", f"{A}rollout.tensor_model_parallel_size=1",
        f"{A}rollout.name={engine}", f"{A}rollout.mode=async", f"{A}rollout.gpu_memory_utilization=0.5",
        f"{A}rollout.n=16", f"{A}rollout.multi_turn.enable=true", f"{A}rollout.multi_turn.max_assistant_turns=5",
        f"{A}ref.log_prob_micro_batch_size_per_gpu=40", f"{A}ref.fsdp_config.param_offload=True",
        "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0", "trainer.logger=['console']",
        "trainer.project_name=gsm8k_async_rl", "trainer.experiment_name=qwen2.5-3b_gsm8k-multiturn-tool-n16",
        "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "trainer.save_freq=-1", "trainer.test_freq=20",
        f"data.train_files={local['train']}", f"data.val_files={local['val']}",
        f"{A}rollout.multi_turn.tool_config_path={VERL_TOOL_YAML}", "trainer.total_epochs=15",
        f"trainer.default_local_dir={local['run']}", f"trainer.cache_dir={local['cache']}",
    ]


def test_verl_multiturn_command_passes_check(local) -> None:
    report = run_checks(verl_multiturn_command(local, "vllm"))
    assert report.problems == [], report.render()
    agent = "\n".join(report.sections["agent"])
    assert "train rows per loop: tool_agent: 256" in agent
    assert "tools: calc_gsm8k_reward (" in agent
    assert "turns: assistant 5, tool no limit" in agent
    assert "step: 256 prompts x rollout.n=16 = 4096 samples" in "\n".join(report.sections["batches"])


def test_verl_multiturn_command_on_sglang_or_tp2_is_refused(local) -> None:
    report = run_checks(verl_multiturn_command(local, "sglang"))
    assert len(report.problems) == 1, report.render()
    assert f"{A}rollout.name='sglang' is not supported" in report.problems[0]
    assert "legal values: ['vllm', 'hf']" in report.problems[0]
    tp2 = [a.replace("tensor_model_parallel_size=1", "tensor_model_parallel_size=2")
           for a in verl_multiturn_command(local, "vllm")]
    problems = run_checks(tp2).problems
    assert len(problems) == 1 and "legal: tensor_model_parallel_size=1" in problems[0], problems
