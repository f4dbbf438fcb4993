"""Prompt datasets read from verl-style parquet files, and deterministic batch iteration.

`PromptDataset` renders each row's chat messages with the tokenizer's chat template (generation
prompt added), tokenizes the result, and keeps the fields a reward function needs (`data_source`,
`ground_truth`, `extra_info`). `iterate_batches` yields shuffled, fixed-size batches per epoch.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pandas as pd

log = logging.getLogger(__name__)


def _plain(value: Any) -> Any:
    """Parquet round-trips lists as numpy arrays; turn nested values back into plain Python."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def _read_frames(files: Sequence[str], prompt_key: str) -> pd.DataFrame:
    frames = []
    for path in files:
        if not os.path.isfile(path):
            raise ValueError(f"dataset file not found: {path}")
        frame = pd.read_parquet(path)
        if len(frame) == 0:
            raise ValueError(f"dataset file {path} is empty (0 rows)")
        if prompt_key not in frame.columns:
            raise ValueError(f"{path} has no {prompt_key!r} column; columns found: {list(frame.columns)}")
        frames.append(frame)
    if not frames:
        raise ValueError("PromptDataset needs at least one parquet file")
    return pd.concat(frames, ignore_index=True)


def _messages(prompt: Any, chat_template: bool = True) -> list[dict[str, Any]] | None:
    """The prompt's chat messages, or None for a completion prompt (a string without chat template)."""
    if isinstance(prompt, str) and not chat_template:
        return None
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        return prompt
    raise ValueError(f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}: {prompt!r}")


def _render(prompt: Any, tokenizer: Any, chat_template: bool = True) -> str:
    messages = _messages(prompt, chat_template)
    if messages is None:
        return prompt  # a completion prompt, tokenized as written
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class PromptDataset:
    """Tokenized prompts of one or more parquet files; items are plain dicts (see `__getitem__`)."""

    def __init__(
        self,
        files: str | list[str],
        tokenizer: Any,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        filter_overlong: bool = True,
        chat_template: bool = True,
    ) -> None:
        paths = [files] if isinstance(files, str) else list(files)
        self.chat_template = chat_template
        frame = _read_frames(paths, prompt_key)
        self.items: list[dict[str, Any]] = []
        dropped = 0
        for row_index, row in enumerate(frame.to_dict(orient="records")):
            item = self._make_item(_plain(row), row_index, prompt_key, tokenizer, chat_template)
            if len(item["prompt_ids"]) > max_prompt_length:
                if not filter_overlong:
                    raise ValueError(
                        f"row {row_index} has {len(item['prompt_ids'])} prompt tokens > max_prompt_length="
                        f"{max_prompt_length}; raise max_prompt_length or set filter_overlong=True"
                    )
                dropped += 1
                continue
            self.items.append(item)
        if dropped:
            log.warning("dropped %d of %d prompts longer than %d tokens (%s)", dropped, len(frame), max_prompt_length, paths)
        self.num_filtered = dropped
        if not self.items:
            longest = max(len(self._make_item(_plain(r), 0, prompt_key, tokenizer, chat_template)["prompt_ids"])
                          for r in frame.head(64).to_dict(orient="records"))
            raise ValueError(f"none of the {len(frame)} prompts of {paths} fits data.max_prompt_length="
                             f"{max_prompt_length} (the first ones are up to {longest} tokens); raise it")

    @staticmethod
    def _make_item(row: dict[str, Any], row_index: int, prompt_key: str, tokenizer: Any,
                   chat_template: bool = True) -> dict[str, Any]:
        text = _render(row[prompt_key], tokenizer, chat_template)
        reward_model = row.get("reward_model") or {}
        extra_info = row.get("extra_info") or {}
        return {
            "prompt_ids": list(tokenizer.encode(text, add_special_tokens=False)),
            "prompt_text": text,
            "messages": _messages(row[prompt_key], chat_template),  # a reward model re-renders them in its template
            "data_source": str(row.get("data_source", "unknown")),
            "ground_truth": str(reward_model.get("ground_truth", "")),
            "extra_info": extra_info,
            "index": int(extra_info.get("index", row_index)),
        }

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


def iterate_batches(
    dataset: PromptDataset | Sequence[dict[str, Any]], batch_size: int, seed: int, epoch: int
) -> Iterator[list[dict[str, Any]]]:
    """Yield full batches of items in an order fixed by (seed, epoch); the remainder is dropped."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if batch_size > len(dataset):
        raise ValueError(f"batch_size={batch_size} exceeds the dataset size {len(dataset)}: no full batch")
    order = list(range(len(dataset)))
    # A private Random: the order depends on (seed, epoch) only, never on the global RNG state.
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    for start in range(0, len(order) - batch_size + 1, batch_size):
        yield [dataset[i] for i in order[start : start + batch_size]]
