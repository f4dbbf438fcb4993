"""One packed micro-batch as a rank sees it: the padded rows, their packed stream and the sp context.

A rank's model inputs are its sequence-parallel shard [S] of the stream (S = T / (ulysses x ring));
the ranks of a tp group share it. Its outputs cover the same [S] tokens, or, with tensor
parallelism's sequence-parallel activations, the tp rank's contiguous [S/tp] block of them.

Legend: B rows, P prompt width, R response width, T packed stream, S local tokens (model inputs).
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
from rlsp.parallel.tensor_parallel import TPInfo
from rlsp.parallel.ulysses import SPContext, build_sp_context, gather_from_ranks, shard_for_rank


@dataclass
class MicroBatch:
    rows: Batch
    packed: PackedBatch
    ctx: SPContext
    prompt_len: int
    response_len: int
    tp: TPInfo | None = None

    def local(self, values_T: torch.Tensor) -> torch.Tensor:
        """This rank's model-input shard [S] of a stream tensor [T]."""
        return shard_for_rank(values_T, self.ctx)

    def out_local(self, values_T: torch.Tensor) -> torch.Tensor:
        """The tokens of a stream tensor [T] that this rank's head outputs cover ([S] or [S/tp])."""
        local = self.local(values_T)
        return local if self.tp is None else self.tp.local_tokens(local)

    @property
    def out_len(self) -> int:
        return self.ctx.local_len if self.tp is None else self.tp.local_len(self.ctx.local_len)

    def response_local(self, key: str) -> torch.Tensor:
        """This rank's tokens of a [B, R] response field of the rows, laid out like the head outputs."""
        return self.out_local(response_to_stream(self.rows[key], self.packed, self.prompt_len))

    def gather(self, values_out: torch.Tensor) -> torch.Tensor:
        """Head outputs of every rank -> the full stream [T] in order (collective; not differentiable)."""
        if self.tp is not None and self.tp.sequence_parallel:
            pieces = [torch.empty_like(values_out) for _ in range(self.tp.size)]
            dist.all_gather(pieces, values_out.contiguous(), group=self.tp.group)
            values_out = torch.cat(pieces)
        return gather_from_ranks(values_out, self.ctx)


def prepare_micro_batch(rows: Batch, prompt_len: int, dims: ParallelDims | None, num_q_heads: int,
                        num_kv_heads: int, tp: TPInfo | None = None) -> MicroBatch:
    """Pack `rows` into one stream and build its sp context over the groups of `dims` (None: unsharded,
    one rank holds the whole stream). The stream is padded to the layout's `stream_multiple`; the head
    counts are those one rank's attention sees (a tp rank's share under tensor parallelism)."""
    multiple = 1 if dims is None else dims.layout.stream_multiple
    packed = pack_sequences(rows["input_ids"], rows["attention_mask"], pad_to_multiple=multiple)
    groups = (None, None) if dims is None else (dims.ulysses_group, dims.ring_group)
    ctx = build_sp_context(groups[0], packed, num_q_heads, num_kv_heads, ring_group=groups[1])
    response_len = rows["input_ids"].shape[1] - prompt_len
    return MicroBatch(rows=rows, packed=packed, ctx=ctx, prompt_len=prompt_len, response_len=response_len, tp=tp)


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
