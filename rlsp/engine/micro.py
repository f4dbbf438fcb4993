"""One packed micro-batch as a rank sees it: the padded rows, their packed stream and the sp context.

Legend: B rows, P prompt width, R response width, T packed stream, S = T / sp local shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlsp.data.batch import Batch
from rlsp.data.packing import PackedBatch, pack_sequences
from rlsp.engine.stream import response_to_stream
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


def prepare_micro_batch(rows: Batch, prompt_len: int, group: dist.ProcessGroup | None, sp_size: int,
                        num_q_heads: int, num_kv_heads: int) -> MicroBatch:
    """Pack `rows` into one stream padded to a multiple of `sp_size` and build its sp context."""
    packed = pack_sequences(rows["input_ids"], rows["attention_mask"], pad_to_multiple=sp_size)
    ctx = build_sp_context(group, packed, num_q_heads, num_kv_heads)
    response_len = rows["input_ids"].shape[1] - prompt_len
    return MicroBatch(rows=rows, packed=packed, ctx=ctx, prompt_len=prompt_len, response_len=response_len)
