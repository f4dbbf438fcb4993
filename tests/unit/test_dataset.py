"""Synthetic arithmetic generator and the parquet PromptDataset / batch iteration."""

from __future__ import annotations

import logging
from collections import Counter

import pandas as pd
import pytest

from rlsp.data.dataset import PromptDataset, iterate_batches
from rlsp.data.tasks.arithmetic import generate_arithmetic, main, write_arithmetic_parquet
from rlsp.models.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def _content(row: dict) -> str:
    return row["prompt"][0]["content"]


def test_rows_have_verl_columns_and_correct_answers() -> None:
    train, test = generate_arithmetic(n_train=200, n_test=25, seed=3, max_operand=4)
    for row in train + test:
        assert row["data_source"] == "rlsp/arithmetic" and row["ability"] == "math"
        assert row["prompt"][0]["role"] == "user" and row["reward_model"]["style"] == "rule"
        a, b = _content(row).rstrip("=").split("+")
        assert row["reward_model"]["ground_truth"] == str(int(a) + int(b))
        assert 0 <= int(a) <= 4 and 0 <= int(b) <= 4
    assert [r["extra_info"]["index"] for r in train] == list(range(200))
    assert {r["extra_info"]["split"] for r in test} == {"test"}


def test_small_space_test_split_is_every_pair_once() -> None:
    train, test = generate_arithmetic(seed=0)  # defaults: operands 0..2, 9 test rows
    assert sorted(_content(r) for r in test) == sorted(f"{a}+{b}=" for a in range(3) for b in range(3))
    assert len(train) == 2048 and {_content(r) for r in train} == {_content(r) for r in test}
    _, test = generate_arithmetic(n_train=10, n_test=25, seed=0, max_operand=4)
    assert sorted(_content(r) for r in test) == sorted(f"{a}+{b}=" for a in range(5) for b in range(5))


def test_large_space_holds_out_test_pairs() -> None:
    train, test = generate_arithmetic(n_train=500, n_test=20, seed=0, max_operand=9)
    train_prompts, test_prompts = {_content(r) for r in train}, {_content(r) for r in test}
    assert len(test_prompts) == 20 and not train_prompts & test_prompts


def test_balanced_answers_are_uniform_and_natural_ones_are_not() -> None:
    balanced, _ = generate_arithmetic(n_train=900, n_test=1, seed=1, max_operand=4)
    counts = Counter(r["reward_model"]["ground_truth"] for r in balanced)
    assert sorted(counts) == [str(i) for i in range(9)] and set(counts.values()) == {100}
    natural, _ = generate_arithmetic(n_train=900, n_test=1, seed=1, max_operand=4, balance_answers=False)
    counts = Counter(r["reward_model"]["ground_truth"] for r in natural)
    assert counts["4"] == 180 and counts["0"] == 36  # 5/25 and 1/25 of the rows


def test_generation_is_seeded() -> None:
    assert generate_arithmetic(50, 5, seed=7) == generate_arithmetic(50, 5, seed=7)
    assert generate_arithmetic(50, 5, seed=7)[0] != generate_arithmetic(50, 5, seed=8)[0]


def test_generator_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="ops="):
        generate_arithmetic(ops=("/",))
    with pytest.raises(ValueError, match="operand range"):
        generate_arithmetic(min_operand=5, max_operand=2)


def test_dataset_reads_generated_parquet(tmp_path, tokenizer) -> None:
    train_path, test_path = write_arithmetic_parquet(str(tmp_path), n_train=64, seed=0)
    ds = PromptDataset([train_path, test_path], tokenizer, max_prompt_length=64)
    assert len(ds) == 64 + 9
    item = ds[0]
    assert set(item) == {"prompt_ids", "prompt_text", "messages", "data_source", "ground_truth", "extra_info", "index",
                         "agent_name"}
    assert item["agent_name"] is None  # no agent loops in this run
    frame = pd.read_parquet(train_path)
    content = frame.iloc[0]["prompt"][0]["content"]
    assert item["messages"] == [{"role": "user", "content": content}]  # for a reward model's own chat template
    assert item["prompt_text"] == f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    assert item["prompt_ids"] == tokenizer.encode(item["prompt_text"], add_special_tokens=False)
    assert item["ground_truth"] == frame.iloc[0]["reward_model"]["ground_truth"]
    assert item["extra_info"]["split"] == "train" and isinstance(item["extra_info"]["index"], int)
    assert ds[64]["extra_info"]["split"] == "test" and ds[64]["index"] == 0


def _mixed_length_parquet(path) -> str:
    rows = [{"data_source": "rlsp/arithmetic", "prompt": [{"role": "user", "content": "1+" * k + "1="}],
             "reward_model": {"style": "rule", "ground_truth": str(k + 1)}, "extra_info": {"index": k}}
            for k in range(1, 7)]
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


def test_overlong_prompts_are_filtered_or_raise(tmp_path, tokenizer, caplog) -> None:
    path = _mixed_length_parquet(tmp_path / "mixed.parquet")
    # Prompt length = 19 template tokens + 2k + 2 content tokens: k=1..6 -> 23, 25, ..., 33.
    with caplog.at_level(logging.WARNING, logger="rlsp.data.dataset"):
        ds = PromptDataset(path, tokenizer, max_prompt_length=27)
    assert [item["index"] for item in ds.items] == [1, 2, 3] and ds.num_filtered == 3
    assert "dropped 3 of 6" in caplog.text
    with pytest.raises(ValueError, match="row 3 has 29 prompt tokens > max_prompt_length=27"):
        PromptDataset(path, tokenizer, max_prompt_length=27, filter_overlong=False)


def test_missing_file_and_missing_column_errors(tmp_path, tokenizer) -> None:
    with pytest.raises(ValueError, match="dataset file not found"):
        PromptDataset(str(tmp_path / "nope.parquet"), tokenizer, 64)
    path = tmp_path / "bad.parquet"
    pd.DataFrame([{"question": "1+1=", "answer": "2"}]).to_parquet(path)
    with pytest.raises(ValueError, match=r"no 'prompt' column; columns found: \['question', 'answer'\]"):
        PromptDataset(str(path), tokenizer, 64)


def test_plain_string_prompt_key(tmp_path, tokenizer) -> None:
    path = tmp_path / "q.parquet"
    pd.DataFrame([{"question": "2+2=", "reward_model": {"ground_truth": "4"}}]).to_parquet(path)
    ds = PromptDataset(str(path), tokenizer, 64, prompt_key="question")
    assert ds[0]["prompt_text"].endswith("2+2=<|im_end|>\n<|im_start|>assistant\n") and ds[0]["ground_truth"] == "4"


def test_iterate_batches_is_deterministic_and_drops_last() -> None:
    items = [{"index": i} for i in range(10)]
    epoch0 = [[it["index"] for it in batch] for batch in iterate_batches(items, 3, seed=1, epoch=0)]
    assert len(epoch0) == 3 and all(len(b) == 3 for b in epoch0)
    assert len({i for b in epoch0 for i in b}) == 9  # no repeats within an epoch
    again = [[it["index"] for it in batch] for batch in iterate_batches(items, 3, seed=1, epoch=0)]
    epoch1 = [[it["index"] for it in batch] for batch in iterate_batches(items, 3, seed=1, epoch=1)]
    assert again == epoch0 and epoch1 != epoch0
    with pytest.raises(ValueError, match="exceeds the dataset size 10"):
        next(iterate_batches(items, 11, seed=1, epoch=0))


def test_cli_writes_both_splits(tmp_path, capsys) -> None:
    main(["--out", str(tmp_path), "--n-train", "30", "--n-test", "5"])
    train_path, test_path = capsys.readouterr().out.split()
    assert len(pd.read_parquet(train_path)) == 30 and len(pd.read_parquet(test_path)) == 5
