"""Building a process's rows from column blocks that live elsewhere: the worker side of the data plane.

A step's data is held in *blocks*: Batches that stay in the processes that made them (a rollout
worker's samples, an actor rank's old logprobs), each holding some columns for some rows. A call
that needs rows sends the process a `RowsSpec`: for every block it reads, which columns and which of
the block's rows go where in the rows being built (`Piece`), plus the columns the driver holds itself
(`by_value`, already in row order). The blocks arrive as objects (the transport resolves them; no
driver in between); `assemble` places every piece and returns one Batch of exactly the declared
columns.

Row broadcasts: a per-row value the driver computed for every token of a row (an outcome advantage) is
sent as one number per row under `<key>@row` and expanded here to `value * response_mask`, the same
expression a token-level computation uses, so the tensors equal what the driver would have built.

Row reports: per-row scalars derived from a process's rows (`ROW_SCALARS`, e.g. the number of tokens
of each row), computed where the rows are and returned to the driver instead of the rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from rlsp.algos.aggregation import masked_sum
from rlsp.data.batch import Batch, response_lengths
from rlsp.models.vision_inputs import MM_KEY

ROW_SUFFIX = "@row"
COLUMNS_INFO = "block_columns"  # a row report's note of the (tensor, meta) columns its block holds

# What a forward pass over rollout rows reads (positions are rebuilt from the mask when packing).
MODEL_INPUTS = ("input_ids", "attention_mask", "response_mask")
# The rows' images a vision-language policy or critic reads (rlsp.models.vision_inputs.MM_KEY): pixel values and grids
# per row, carried from the prompt into its samples; an optional read (text rows have none).
IMAGE_INPUTS = (MM_KEY,)
# What a forward of the policy (actor, reference, teachers) or the critic reads: the model inputs and the rows' images.
POLICY_INPUTS = (*MODEL_INPUTS, *IMAGE_INPUTS)
# The per-row fields a prompt carries from its dataset row into its samples.
ROW_FIELDS = ("uid", "data_source", "ground_truth", "extra_info", "index", "messages", "agent_name")


@dataclass(frozen=True)
class Piece:
    """Rows `src` of argument `arg` (a block) for columns `keys`, placed at positions `dst` under `names`
    (the same names when empty; another name where a column serves as another, e.g. the rollout's
    logprobs as the old logprobs)."""

    arg: int
    keys: tuple[str, ...]
    src: tuple[int, ...]
    dst: tuple[int, ...]
    names: tuple[str, ...] = ()


@dataclass
class RowsSpec:
    """How a process builds its rows: `rows` rows from `pieces` of the blocks it receives and the
    driver's own columns (`by_value`, rows in order); `info` is the batch-level values."""

    rows: int
    pieces: list[Piece] = field(default_factory=list)
    by_value: Batch | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def keys(self) -> set[str]:
        held = {k for p in self.pieces for k in (p.names or p.keys)}
        return held | (set(self.by_value.tensors.keys()) | set(self.by_value.meta) if self.by_value is not None else set())


def _is_tensor(block: Batch, key: str) -> bool:
    return key in block.tensors.keys()


def assemble(spec: RowsSpec, blocks: Sequence[Batch]) -> Batch:
    """The rows `spec` describes, from `blocks` (the call's block arguments, in order)."""
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, list[Any]] = {}
    for piece in spec.pieces:
        block = blocks[piece.arg]
        src = torch.as_tensor(piece.src, dtype=torch.long)
        dst = torch.as_tensor(piece.dst, dtype=torch.long)
        for key, name in zip(piece.keys, piece.names or piece.keys):
            if _is_tensor(block, key):
                values = block[key]
                out = tensors.get(name)
                if out is None:
                    out = tensors[name] = values.new_zeros((spec.rows, *values.shape[1:]))
                out[dst] = values[src]
            else:
                column = meta.setdefault(name, [None] * spec.rows)
                for s, d in zip(piece.src, piece.dst):
                    column[d] = block.meta[key][s]
    if spec.by_value is not None:
        tensors.update({k: spec.by_value[k] for k in spec.by_value.tensors.keys()})
        meta.update(spec.by_value.meta)
    batch = Batch(TensorDict(tensors, batch_size=[spec.rows]), meta, dict(spec.info))
    return expand_row_broadcasts(batch)


def expand_row_broadcasts(batch: Batch) -> Batch:
    """`<key>@row` [B] becomes `key` [B, R] = value * response_mask (see the module docstring)."""
    for name in [k for k in batch.tensors.keys() if k.endswith(ROW_SUFFIX)]:
        values_B = batch.tensors.pop(name)
        mask_BR = batch["response_mask"]
        batch.set(name[: -len(ROW_SUFFIX)], values_B.unsqueeze(-1) * mask_BR)
    return batch


def _logprob_diff(batch: Batch) -> torch.Tensor:
    return (batch["rollout_logprobs"] - batch["old_logprobs"]).abs() * batch["response_mask"]


# Per-row scalars a process reports about its rows (name -> function of the rows).
ROW_SCALARS: dict[str, Callable[[Batch], torch.Tensor]] = {
    "num_tokens": lambda b: b["attention_mask"].sum(-1).long(),
    "prompt_tokens": lambda b: b["attention_mask"][:, : b["input_ids"].shape[1] - b["response_mask"].shape[1]].sum(-1).long(),
    "response_tokens": lambda b: b["response_mask"].sum(-1),
    "response_length": lambda b: torch.tensor(response_lengths(b), dtype=torch.long),
    "logprob_diff_sum": lambda b: _logprob_diff(b).sum(-1),
    "logprob_diff_max": lambda b: _logprob_diff(b).amax(-1) if b["response_mask"].shape[1] else torch.zeros(len(b)),
    "step_reward_sum": lambda b: b["step_rewards"].sum(-1),
    # the step rewards the token-level scores hold (those on policy tokens), summed: DAPO's seq_reward reads it
    "step_reward_policy_sum": lambda b: (b["step_rewards"] * b["response_mask"]).sum(-1),
    # the reward model's row score, and the row's summed token-level score as estimators compute it
    "rm_score": lambda b: b["rm_scores"].sum(-1),
    "rm_row_reward": lambda b: masked_sum(b["rm_scores"], b["response_mask"], dim=-1),
}


def row_report(batch: Batch, keys: Sequence[str]) -> Batch:
    """The per-row values named `keys` of `batch`: derived scalars (ROW_SCALARS), or its own tensors and
    meta (small per-row entries such as uid); keys neither derivable nor present are left out."""
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, list[Any]] = {}
    for key in keys:
        if key in ROW_SCALARS:
            try:
                tensors[key] = ROW_SCALARS[key](batch)
            except KeyError:  # an input it needs is not in these rows (e.g. no step rewards)
                continue
        elif key in batch.tensors.keys():
            tensors[key] = batch[key]
        elif key in batch.meta:
            meta[key] = batch.meta[key]
    return Batch(TensorDict(tensors, batch_size=[len(batch)]), meta, dict(batch.info))
