"""verl-layout parquet from the shipped GSM8K/MATH samples and the word-problem generator, and the rows of
verl's GSM8K multi-turn tool example (`gsm8k_multiturn`).

The written files are read back with pyarrow (column names and types) and pandas (values), and
loaded by `PromptDataset` with a chat tokenizer, as a training run would.
"""

from __future__ import annotations

import os

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlsp.agent.tools.gsm8k import GSM8K_TOOL_SCHEMA
from rlsp.data.dataset import AgentRows, PromptDataset
from rlsp.data.preprocess import (
    GSM8K_INSTRUCTION,
    GSM8K_TOOL_SYSTEM_PROMPT,
    MATH_INSTRUCTION,
    main,
    preprocess,
    read_records,
)
from rlsp.data.tasks.word_problems import INSTRUCTION, TEMPLATES, generate_word_problems, write_word_problems_parquet
from rlsp.models.tokenizer import build_char_tokenizer
from rlsp.rewards import score_batch
from rlsp.run.assets import resolve_data_files

DATA = os.path.join(os.path.dirname(__file__), "..", "data")
GSM8K_SAMPLE = os.path.join(DATA, "gsm8k_sample.jsonl")
MATH_SAMPLE = os.path.join(DATA, "math_sample.jsonl")
COLUMNS = ["data_source", "prompt", "ability", "reward_model", "extra_info"]
MULTITURN_COLUMNS = ["data_source", "agent_name", "prompt", "ability", "reward_model", "extra_info"]
MULTITURN_EXTRA = {"split", "index", "answer", "question", "need_tools_kwargs", "tools_kwargs", "interaction_kwargs"}


def check_layout(path: str, data_source: str, extra_keys: set[str]) -> pd.DataFrame:
    schema = pq.read_schema(path)
    assert schema.names == COLUMNS
    assert schema.field("data_source").type == pa.string() and schema.field("ability").type == pa.string()
    prompt = schema.field("prompt").type
    assert pa.types.is_list(prompt) and pa.types.is_struct(prompt.value_type)
    assert {(f.name, f.type) for f in prompt.value_type} == {("role", pa.string()), ("content", pa.string())}
    reward = schema.field("reward_model").type
    assert {reward.field(i).name for i in range(reward.num_fields)} == {"style", "ground_truth"}
    assert reward.field("ground_truth").type == pa.string()
    extra = schema.field("extra_info").type
    assert {extra.field(i).name for i in range(extra.num_fields)} == {"split", "index"} | extra_keys
    frame = pd.read_parquet(path)
    assert (frame["data_source"] == data_source).all() and (frame["ability"] == "math").all()
    assert all(len(p) == 1 and p[0]["role"] == "user" for p in frame["prompt"])
    assert all(rm["style"] == "rule" for rm in frame["reward_model"])
    assert [e["index"] for e in frame["extra_info"]] == list(range(len(frame)))
    return frame


def test_gsm8k_layout_and_ground_truth(tmp_path) -> None:
    path = preprocess("gsm8k", GSM8K_SAMPLE, str(tmp_path), split="test")
    assert path == str(tmp_path / "test.parquet")
    frame = check_layout(path, "openai/gsm8k", {"question", "answer"})
    records = read_records(GSM8K_SAMPLE)
    assert len(frame) == len(records) == 20
    truths = [rm["ground_truth"] for rm in frame["reward_model"]]
    assert truths[:3] == ["16", "11", "1500"]  # "#### 1,500" loses its comma
    assert "-4" in truths and "0.375" in truths and "16.75" in truths
    first = frame.iloc[0]
    assert first["prompt"][0]["content"] == f"{records[0]['question']} {GSM8K_INSTRUCTION}"
    assert first["extra_info"]["split"] == "test" and first["extra_info"]["answer"] == records[0]["answer"]
    # The reference solutions score 1.0 under the scorer the data_source selects.
    sources = list(frame["data_source"])
    assert score_batch(sources, [r["answer"] for r in records], truths) == [1.0] * len(records)


def test_math_layout_and_ground_truth(tmp_path) -> None:
    path = preprocess("math", MATH_SAMPLE, str(tmp_path))
    frame = check_layout(path, "DigitalLearningGmbH/MATH-lighteval", {"level", "type"})
    records = read_records(MATH_SAMPLE)
    truths = [rm["ground_truth"] for rm in frame["reward_model"]]
    assert truths[0] == "\\frac{11}{12}"
    assert truths[4] == "\\left( 3, \\frac{\\pi}{2} \\right)"  # nested braces kept whole
    assert frame.iloc[1]["prompt"][0]["content"].endswith(MATH_INSTRUCTION)
    assert frame.iloc[2]["extra_info"]["type"] == "Number Theory" and frame.iloc[2]["extra_info"]["split"] == "train"
    assert score_batch(list(frame["data_source"]), [r["solution"] for r in records], truths) == [1.0] * len(records)


def test_parquet_input_and_cli(tmp_path, capsys) -> None:
    exported = tmp_path / "train-00000-of-00001.parquet"  # the Hub's parquet export layout
    pd.DataFrame(read_records(GSM8K_SAMPLE)).to_parquet(exported)
    main(["gsm8k", "--input", str(exported), "--output", str(tmp_path / "out")])
    written = capsys.readouterr().out.strip()
    assert written == str(tmp_path / "out" / "train.parquet")
    check_layout(written, "openai/gsm8k", {"question", "answer"})


def test_bad_inputs_name_the_problem(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "no marker"}\n')
    with pytest.raises(ValueError, match="no '#### <number>' line"):
        preprocess("gsm8k", str(bad), str(tmp_path))
    with pytest.raises(ValueError, match=r"lacks \['problem', 'solution'\]"):
        preprocess("math", str(bad), str(tmp_path))
    with pytest.raises(ValueError, match="legal: \\['geo3k', 'gsm8k', 'gsm8k_multiturn', 'math'\\]"):
        preprocess("mmlu", str(bad), str(tmp_path))
    (tmp_path / "x.csv").write_text("a\n")
    with pytest.raises(ValueError, match="unsupported extension"):
        read_records(str(tmp_path / "x.csv"))


def test_gsm8k_multiturn_rows_are_verls_tool_example_rows(tmp_path) -> None:
    path = preprocess("gsm8k_multiturn", GSM8K_SAMPLE, str(tmp_path), split="test")
    schema = pq.read_schema(path)
    assert schema.names == MULTITURN_COLUMNS and schema.field("agent_name").type == pa.string()
    extra = schema.field("extra_info").type
    assert {extra.field(i).name for i in range(extra.num_fields)} == MULTITURN_EXTRA
    frame = pd.read_parquet(path)
    single = pd.read_parquet(preprocess("gsm8k", GSM8K_SAMPLE, str(tmp_path / "single"), split="test"))
    assert len(frame) == len(single) == 20 and (frame["agent_name"] == "tool_agent").all()
    for row, plain in zip(frame.to_dict(orient="records"), single.to_dict(orient="records"), strict=True):
        truth = plain["reward_model"]["ground_truth"]
        assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
        assert row["reward_model"] == {"style": "rule", "ground_truth": truth}
        assert [dict(m) for m in row["prompt"]] == [{"role": "system", "content": GSM8K_TOOL_SYSTEM_PROMPT},
                                                    dict(plain["prompt"][0])]
        info = row["extra_info"]
        assert info["tools_kwargs"] == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}}
        assert info["interaction_kwargs"] == {"name": "gsm8k", "query": plain["prompt"][0]["content"],
                                              "ground_truth": truth}
        assert info["need_tools_kwargs"] is True
        assert {k: info[k] for k in ("split", "index", "answer", "question")} == plain["extra_info"]
    assert frame.iloc[2]["extra_info"]["tools_kwargs"]["calc_gsm8k_reward"]["create_kwargs"]["ground_truth"] == "1500"
    assert "`calc_gsm8k_reward`" in GSM8K_TOOL_SYSTEM_PROMPT and "`#### <answer>`" in GSM8K_TOOL_SYSTEM_PROMPT


def test_gsm8k_multiturn_cli_and_dataset_items(tmp_path, capsys) -> None:
    main(["gsm8k_multiturn", "--input", GSM8K_SAMPLE, "--output", str(tmp_path)])
    path = capsys.readouterr().out.strip()
    assert path == str(tmp_path / "train.parquet")
    tokenizer = build_char_tokenizer()
    agent = AgentRows("single_turn_agent", (GSM8K_TOOL_SCHEMA,))
    item = PromptDataset(path, tokenizer, max_prompt_length=2048, agent=agent)[0]
    assert item["agent_name"] == "tool_agent" and item["ground_truth"] == "16"
    assert item["messages"][0] == {"role": "system", "content": GSM8K_TOOL_SYSTEM_PROMPT}
    assert item["extra_info"]["tools_kwargs"] == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "16"}}}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "no marker"}\n')
    with pytest.raises(ValueError, match="gsm8k record 0: answer has no '#### <number>' line"):
        preprocess("gsm8k_multiturn", str(bad), str(tmp_path))


def test_prompt_dataset_reads_the_layout(tmp_path) -> None:
    tokenizer = build_char_tokenizer()
    path = preprocess("gsm8k", GSM8K_SAMPLE, str(tmp_path))
    dataset = PromptDataset(path, tokenizer, max_prompt_length=1024)
    frame = pd.read_parquet(path)
    assert len(dataset) == len(frame)
    item = dataset[2]
    assert item["data_source"] == "openai/gsm8k" and item["ground_truth"] == "1500" and item["index"] == 2
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": frame.iloc[2]["prompt"][0]["content"]}], tokenize=False, add_generation_prompt=True
    )
    assert item["prompt_text"] == expected
    assert item["prompt_ids"] == tokenizer.encode(expected, add_special_tokens=False)
    assert item["extra_info"]["question"].startswith("A library had 1,250 books")


def test_word_problems_are_deterministic_and_held_out() -> None:
    train, test = generate_word_problems(n_train=600, n_test=100, seed=3)
    again_train, again_test = generate_word_problems(n_train=600, n_test=100, seed=3)
    assert train == again_train and test == again_test
    other_train, _ = generate_word_problems(n_train=600, n_test=100, seed=4)
    assert other_train != train
    test_questions = {r["extra_info"]["question"] for r in test}
    assert len(test_questions) == 100
    assert not test_questions & {r["extra_info"]["question"] for r in train}
    assert {r["extra_info"]["template"] for r in test} == {t.name for t in TEMPLATES}
    for row in train[:50] + test:
        truth = int(row["reward_model"]["ground_truth"])
        assert truth > 0
        assert row["prompt"][0]["content"].endswith(INSTRUCTION)
        assert row["extra_info"]["answer"].endswith(f"#### {truth}")
        # The worked solution is right: the scorer of the row's data_source gives it full marks.
        assert score_batch([row["data_source"]], [row["extra_info"]["answer"]], [str(truth)]) == [1.0]


def test_word_problems_parquet_and_builtin_name(tmp_path) -> None:
    train_path, test_path = write_word_problems_parquet(str(tmp_path), n_train=64, n_test=16, seed=0)
    check_layout(train_path, "openai/gsm8k", {"question", "answer", "template"})
    assert len(pd.read_parquet(test_path)) == 16
    files = resolve_data_files(["builtin://word_problems/train", "builtin://word_problems/test"], str(tmp_path))
    assert files == [str(tmp_path / "data" / "word_problems" / f"{s}.parquet") for s in ("train", "test")]
    assert pq.read_table(files[1]).to_pylist() == generate_word_problems()[1]  # the defaults, round-tripped
    with pytest.raises(ValueError, match="builtin://word_problems/test"):
        resolve_data_files("builtin://word_problems/dev", str(tmp_path))
