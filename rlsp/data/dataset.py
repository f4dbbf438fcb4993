"""Prompt datasets read from verl-style parquet files, and deterministic batch iteration.

`PromptDataset` renders each row's chat messages with the tokenizer's chat template (generation
prompt added), tokenizes the result, and keeps the fields a reward function needs (`data_source`,
`ground_truth`, `extra_info`). A prompt longer than `max_prompt_length` is dropped (filter_overlong),
else refused or cut as verl's `data.truncation` says: "left" keeps its last tokens, "right" its first,
"middle" both ends (half each). `iterate_batches` yields fixed-size batches per epoch, shuffled or in
file order. `prompt_report` counts what a dataset holds without building it (for `rlsp.check`).
`template_kwargs` (verl's `data.apply_chat_template_kwargs`, e.g. enable_thinking) go to every
apply_chat_template call, here and in the agent loops' renders (rlsp.agent.chat).
Files with an image column (verl's multimodal rows) render through the model's processor instead
(rlsp.data.multimodal): image placeholders expanded in `prompt_ids`, so every length count and cut above
counts the image tokens; items then also carry `multi_modal_inputs`, `images` and `image_tokens`.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from rlsp.config.choices import TRUNCATIONS
from rlsp.data import multimodal as mm

log = logging.getLogger(__name__)
# Columns a verl-layout row may carry beyond the prompt (all optional; see PromptDataset._make_item).
OPTIONAL_COLUMNS = ("data_source", "reward_model", "extra_info")


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
        if mm.IMAGE_KEY in frame.columns or mm.VIDEO_KEY in frame.columns:
            frame[mm.SOURCE_COLUMN] = path  # relative image paths resolve from it; errors name it
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


@dataclass(frozen=True)
class AgentRows:
    """Rows run through agent loops: the loop of rows without an `agent_name` column value, and the tools'
    schemas, which the chat template renders into the prompts of rows whose loop is not single_turn_agent."""

    default_loop: str
    tools: tuple[dict[str, Any], ...] = field(default=(), hash=False)  # dicts: compared, not hashed

    def loop_of(self, row: dict[str, Any]) -> str:
        name = row.get("agent_name")  # absent, None, or NaN where a parquet column is set on some rows only
        return name if isinstance(name, str) and name else self.default_loop


def chat_template_kwargs(cfg: Any) -> dict[str, Any]:
    """The run's `data.apply_chat_template_kwargs` as a plain dict (what every chat-template render is given)."""
    from omegaconf import OmegaConf  # noqa: PLC0415

    kwargs = cfg.data.apply_chat_template_kwargs
    return dict(OmegaConf.to_container(kwargs, resolve=True) if OmegaConf.is_config(kwargs) else kwargs or {})


def _render(prompt: Any, tokenizer: Any, chat_template: bool = True, tools: list[dict[str, Any]] | None = None,
            template_kwargs: Mapping[str, Any] | None = None) -> str:
    messages = _messages(prompt, chat_template)
    if messages is None:
        return prompt  # a completion prompt, tokenized as written
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True,
                                         **(template_kwargs or {}))


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
        truncation: str = "error",
        agent: AgentRows | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        processor: Any = None,
    ) -> None:
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation={truncation!r} is not supported; legal values: {list(TRUNCATIONS)}")
        paths = [files] if isinstance(files, str) else list(files)
        self.chat_template = chat_template
        frame = _read_frames(paths, prompt_key)
        processor = mm.dataset_processor(frame, tokenizer, processor)  # None: text rows, rendered as before
        self.items: list[dict[str, Any]] = []
        dropped = 0
        for row_index, row in enumerate(frame.to_dict(orient="records")):
            item = self._make_item(_plain(row), row_index, prompt_key, tokenizer, chat_template, agent,
                                   template_kwargs, processor)
            if len(item["prompt_ids"]) > max_prompt_length:
                if filter_overlong:
                    dropped += 1
                    continue
                if truncation == "error":
                    raise ValueError(
                        f"row {row_index} has {len(item['prompt_ids'])} prompt tokens > max_prompt_length="
                        f"{max_prompt_length}; raise data.max_prompt_length, set data.filter_overlong_prompts=true "
                        "or data.truncation=left|right|middle"
                    )
                cut = truncate(item["prompt_ids"], max_prompt_length, truncation)
                if processor is not None:
                    mm.check_truncation(item["prompt_ids"], cut, processor, row_index)
                item["prompt_ids"] = cut
            self.items.append(item)
        if dropped:
            log.warning("dropped %d of %d prompts longer than %d tokens (%s)", dropped, len(frame), max_prompt_length, paths)
        self.num_filtered = dropped
        if not self.items:
            longest = max(len(self._make_item(_plain(r), 0, prompt_key, tokenizer, chat_template, agent,
                                              template_kwargs, processor)["prompt_ids"])
                          for r in frame.head(64).to_dict(orient="records"))
            raise ValueError(f"none of the {len(frame)} prompts of {paths} fits data.max_prompt_length="
                             f"{max_prompt_length} (the first ones are up to {longest} tokens); raise it")

    @staticmethod
    def _make_item(row: dict[str, Any], row_index: int, prompt_key: str, tokenizer: Any,
                   chat_template: bool = True, agent: AgentRows | None = None,
                   template_kwargs: Mapping[str, Any] | None = None, processor: Any = None) -> dict[str, Any]:
        loop = agent.loop_of(row) if agent is not None else None
        tools = list(agent.tools) if agent is not None and loop != "single_turn_agent" else None
        reward_model = row.get("reward_model") or {}
        extra_info = row.get("extra_info") or {}
        if processor is not None:  # an image dataset: the processor renders and expands the placeholders
            rendered = mm.vision_item(row, row_index, _messages(row[prompt_key], chat_template),
                                    processor, tools, template_kwargs)
        else:
            text = _render(row[prompt_key], tokenizer, chat_template, tools, template_kwargs)
            rendered = {"prompt_ids": list(tokenizer.encode(text, add_special_tokens=False)), "prompt_text": text}
        return {
            **rendered,
            "messages": _messages(row[prompt_key], chat_template),  # a reward model re-renders them in its template
            "data_source": str(row.get("data_source", "unknown")),
            "ground_truth": str(reward_model.get("ground_truth", "")),
            "extra_info": extra_info,
            "index": int(extra_info.get("index", row_index)),
            "agent_name": loop,  # the agent loop of the row (None: no agent loops in this run)
        }

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


def truncate(ids: list[int], limit: int, side: str) -> list[int]:
    """`ids` cut to `limit` tokens: "left" keeps the end, "right" the start, "middle" both ends (verl's rule)."""
    if len(ids) <= limit:
        return ids
    if side == "left":
        return ids[len(ids) - limit:]
    if side == "right":
        return ids[:limit]
    if side == "middle":
        head = limit // 2
        return ids[:head] + ids[len(ids) - (limit - head):]
    raise ValueError(f"truncation={side!r} cuts nothing; legal values: {list(TRUNCATIONS[1:])}")


def iterate_batches(
    dataset: PromptDataset | Sequence[dict[str, Any]], batch_size: int, seed: int, epoch: int, shuffle: bool = True
) -> Iterator[list[dict[str, Any]]]:
    """Yield full batches of items in an order fixed by (seed, epoch), or in file order without
    `shuffle`; the remainder is dropped."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if batch_size > len(dataset):
        raise ValueError(f"batch_size={batch_size} exceeds the dataset size {len(dataset)}: no full batch")
    order = list(range(len(dataset)))
    if shuffle:  # a private Random: the order depends on (seed, epoch) only, never on the global RNG state
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    for start in range(0, len(order) - batch_size + 1, batch_size):
        yield [dataset[i] for i in order[start : start + batch_size]]


@dataclass
class PromptReport:
    """What `prompt_report` found in a set of parquet files (nothing is kept in memory)."""

    rows: int = 0
    lengths: list[int] = field(default_factory=list)  # prompt tokens of every row, in file order
    missing_columns: list[str] = field(default_factory=list)  # optional verl columns no file has
    sources: set[str] = field(default_factory=set)  # data_source values (they pick the rule reward)
    problems: list[str] = field(default_factory=list)  # unreadable files, rows that cannot be rendered
    agent_loops: dict[str, int] = field(default_factory=dict)  # rows per agent loop (runs with agent loops)
    image_tokens: list[int] = field(default_factory=list)  # per rendered row of files with images (else empty)

    def overlong(self, limit: int) -> int:
        return sum(n > limit for n in self.lengths)


def prompt_report(files: Sequence[str], tokenizer: Any, prompt_key: str = "prompt",
                  chat_template: bool = True, agent: AgentRows | None = None,
                  template_kwargs: Mapping[str, Any] | None = None, processor: Any = None) -> PromptReport:
    """Rows, prompt token lengths (image tokens included) and missing columns of `files`, collecting every
    problem; `processor` renders files with images (None: the model directory's, read when a file has images)."""
    report, seen = PromptReport(), set()
    for path in files:
        try:
            frame = _read_frames([path], prompt_key)
            row_processor = mm.dataset_processor(frame, tokenizer, processor)
        except (ValueError, OSError) as exc:
            report.problems.append(str(exc))
            continue
        seen.update(frame.columns)
        for row_index, row in enumerate(frame.to_dict(orient="records")):
            try:
                item = PromptDataset._make_item(_plain(row), row_index, prompt_key, tokenizer, chat_template, agent,
                                                template_kwargs, row_processor)
            except (ValueError, TypeError, AttributeError) as exc:
                where = f"{path} row {row_index}"  # image-row errors name file and row themselves
                report.problems.append(str(exc) if str(exc).startswith(where) else f"{where}: {exc}")
                continue
            report.lengths.append(len(item["prompt_ids"]))
            if row_processor is not None:
                report.image_tokens.append(item["image_tokens"])
            report.sources.add(item["data_source"])
            if item["agent_name"] is not None:
                report.agent_loops[item["agent_name"]] = report.agent_loops.get(item["agent_name"], 0) + 1
        report.rows += len(frame)
    report.missing_columns = [c for c in OPTIONAL_COLUMNS if seen and c not in seen]
    return report
