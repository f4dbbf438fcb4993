"""What the loop asks the rollout engines for: the prompt datasets, prompt rows from their items (and the
step's, kept for a second pass), the sampling parameters of a step (or of validation), and the training batches
from a data position on."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from typing import Any

import torch

from rlsp.agent.rows import agent_rows, check_agent_names
from rlsp.config.run_length import data_batch
from rlsp.data.batch import Batch
from rlsp.data.dataset import PromptDataset, chat_template_kwargs, iterate_batches
from rlsp.data.multimodal import multimodal_meta


def load_datasets(cfg: Any, tokenizer: Any) -> tuple[PromptDataset, PromptDataset | None]:
    """(the training prompts, the validation prompts or None), rendered with the chat template; with agent
    loops, each row's `agent_name` checked against the configured loops."""
    d, agent = cfg.data, agent_rows(cfg)

    def dataset(files: Any) -> PromptDataset:
        return PromptDataset(files, tokenizer, d.max_prompt_length, d.prompt_key, d.filter_overlong_prompts,
                             chat_template=d.apply_chat_template, truncation=d.truncation, agent=agent,
                             template_kwargs=chat_template_kwargs(cfg))

    train, val = dataset(d.train_files), dataset(d.val_files) if d.val_files else None
    if agent is not None:
        check_agent_names(cfg, [train, val])
    return train, val


def prompt_batch(items: list[dict[str, Any]], uids: list[str] | None = None) -> Batch:
    """One prompt row per dataset item (the generate call's input); a fresh uid per prompt unless `uids`."""
    return Batch.from_dict(
        {"prompt_index": torch.arange(len(items))},
        meta={
            "prompt_ids": [it["prompt_ids"] for it in items],
            "uid": uids or [uuid.uuid4().hex for _ in items],
            "data_source": [it["data_source"] for it in items],
            "ground_truth": [it["ground_truth"] for it in items],
            "extra_info": [it.get("extra_info") for it in items],
            "index": [it.get("index") for it in items],
            "messages": [it.get("messages") for it in items],  # chat turns, for a reward model's own template
            "agent_name": [it.get("agent_name") for it in items],  # the agent loop of each row (None: single turn)
            **multimodal_meta(items),  # a vision-language dataset's images (processor outputs and raw bytes)
        },
    )


class StepPrompts:
    """The prompt rows (`prompt_batch`) a step sent to the engines, every generation round of it (dynamic
    sampling), kept on the driver: a pass that needs a sample's prompt again (ReMax's greedy baseline) takes it
    from here by uid instead of reading the samples' token columns back from the workers."""

    def __init__(self) -> None:
        self.parts: list[Batch] = []

    def clear(self) -> None:
        """A new step: forget the last step's prompts."""
        self.parts = []

    def add(self, prompts: Batch) -> None:
        self.parts.append(prompts)

    def rows(self) -> Batch:
        """Every prompt row of the step, in the order they were sent."""
        if not self.parts:
            raise RuntimeError("no prompt rows were kept for this step: its samples came from elsewhere than "
                               "RayTrainer.generate (a rollout pool's units)")
        keys = {k for part in self.parts for k in part.meta}
        return Batch.concat([_with_meta(part, keys) for part in self.parts])


def _with_meta(prompts: Batch, keys: set[str]) -> Batch:
    """`prompts` with every meta field in `keys`: a round of text-only items from an image dataset has no image
    fields (`multimodal_meta`), filled here as a text row's (no processor outputs, no images)."""
    missing = {k: [[] if k == "images" else None for _ in range(len(prompts))] for k in keys - set(prompts.meta)}
    return Batch(prompts.tensors, {**prompts.meta, **missing}, dict(prompts.info)) if missing else prompts


def sampling_params(cfg: Any, step: int, *, validate: bool = False) -> dict[str, Any]:
    """The engines' sampling parameters for training step `step`, or for validation (val_kwargs, seed 0)."""
    r, d = cfg.actor_rollout_ref.rollout, cfg.data
    if validate:
        v = r.val_kwargs
        greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": -1}
        chosen = {"temperature": v.temperature, "top_p": v.top_p, "top_k": v.top_k} if v.do_sample else greedy
        return {"n": v.n, **chosen, "max_tokens": d.max_response_length, "seed": 0}
    # Far-apart bases per step: the samples of one step use base .. base + prompts * n - 1.
    seed = (cfg.trainer.seed * 100_003 + step) * 1_000_003 % 2**62
    return {"n": r.n, "temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
            "max_tokens": d.max_response_length, "seed": seed, "ignore_eos": r.ignore_eos}


def batch_stream(train_set: PromptDataset, cfg: Any, data_pos: tuple[int, int], endless: bool
                 ) -> Iterator[tuple[tuple[int, int], list[dict[str, Any]]]]:
    """(the data position once this batch is consumed, the batch's items) of each training batch from
    `data_pos` = (epoch, batches of that epoch consumed) on; over trainer.total_epochs, or `endless`ly (dynamic
    sampling consumes extra batches: its steps may need epochs beyond total_epochs)."""
    d = cfg.data
    first_epoch, skip = data_pos
    epochs = itertools.count(first_epoch) if endless else range(first_epoch, cfg.trainer.total_epochs)
    for epoch in epochs:
        for i, items in enumerate(iterate_batches(train_set, data_batch(cfg)[1], d.seed, epoch, d.shuffle)):
            if epoch == first_epoch and i < skip:
                continue
            yield (epoch, i + 1), items
