"""One packed micro-batch as a rank sees it: the padded rows, their packed stream and the sp context.

Legend: B rows, P prompt width, R response width, T packed stream, S = T / token shards local tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlsp.data.balance import count_token_bins, plan_token_bins
from rlsp.data.batch import Batch
from rlsp.data.packing import PackedBatch, pack_sequences
from rlsp.engine.stream import response_to_stream
from rlsp.parallel.mesh import ParallelDims
from rlsp.parallel.ulysses import SPContext, build_sp_context, shard_for_rank


@dataclass
class MicroBatch:
    rows: Batch
    packed: PackedBatch
    ctx: SPContext
    prompt_len: int
    response_len: int

    def local(self, values_T: torch.Tensor) -> torch.Tensor:
        return shard_for_rank(values_T, self.ctx)

    def response_local(self, key: str) -> torch.Tensor:
        """This rank's shard of a [B, R] response field of the rows, laid out like the head outputs."""
        return self.local(response_to_stream(self.rows[key], self.packed, self.prompt_len))


def prepare_micro_batch(rows: Batch, prompt_len: int, dims: ParallelDims | None, num_q_heads: int,
                        num_kv_heads: int) -> MicroBatch:
    """Pack `rows` into one stream and build its sp context over the groups of `dims` (None: unsharded,
    one rank holds the whole stream). The stream is padded to the layout's `stream_multiple`."""
    multiple = 1 if dims is None else dims.layout.stream_multiple
    packed = pack_sequences(rows["input_ids"], rows["attention_mask"], pad_to_multiple=multiple)
    groups = (None, None) if dims is None else (dims.ulysses_group, dims.ring_group)
    ctx = build_sp_context(groups[0], packed, num_q_heads, num_kv_heads, ring_group=groups[1])
    response_len = rows["input_ids"].shape[1] - prompt_len
    return MicroBatch(rows=rows, packed=packed, ctx=ctx, prompt_len=prompt_len, response_len=response_len)


def split_rows(batch: Batch, micro_size: int, max_tokens: int | None, token_shards: int) -> list[list[int]]:
    """Row indices of each micro-batch of this rank's `batch` (collective when `max_tokens` is set).

    Fixed size: consecutive runs of `micro_size` rows. Token budget (`max_tokens` per rank, so a packed
    stream holds up to max_tokens * token_shards tokens, the pieces the layout cuts a stream into):
    every rank of the world runs the same number of micro-batches — the largest any rank needs —
    because each forward's FSDP all-gathers are collective.
    """
    n = len(batch)
    if max_tokens is None:
        return [list(range(i, min(i + micro_size, n))) for i in range(0, n, micro_size)]
    lengths = batch["attention_mask"].sum(-1).tolist()
    budget = max_tokens * token_shards
    need = torch.tensor([count_token_bins(lengths, budget), -n], dtype=torch.int64)
    dist.all_reduce(need, op=dist.ReduceOp.MAX)
    most, fewest_rows = int(need[0]), int(-need[1])
    return plan_token_bins(lengths, budget, min(most, fewest_rows))
