"""The loss context of one packed micro-batch on one rank (rlsp.algos.loss_context.LossContext).

A rank's head outputs cover its shard of the packed stream (Ulysses, ring, tp's sequence-parallel
block); every rank of the shard groups also holds the micro-batch's full padded rows. So the row
structure (which response token belongs to which row) is known locally, and only values need
communicating: ``to_batch`` all-gathers the stream once (the micro-batch's gather, detached) and reads
the response tokens out of the padded rows; ``from_batch`` places [N] values back on this rank's tokens
with no communication. The result is the same on every rank of a row's shard group, and the same as one
rank holding the whole micro-batch.

Legend: B rows, R response width, T packed stream, N response tokens of the micro-batch.
"""

from __future__ import annotations

import torch

from rlsp.algos.loss_context import LossContext
from rlsp.engine.micro import MicroBatch
from rlsp.engine.stream import stream_to_response


class MicroBatchContext(LossContext):
    """Row and micro-batch statistics of ``micro`` for the loss of one rank's tokens (on ``device``)."""

    def __init__(self, micro: MicroBatch, device: torch.device) -> None:
        self._micro = micro
        self._device = device
        # Row bookkeeping stays on the host, where the packing indices live (as the engine's _to_rows does);
        # only the gathered values and the results travel to `device`.
        self._mask_BR = micro.rows["response_mask"].detach().cpu().bool()
        self._row_ids = self._mask_BR.nonzero()[:, 0]

    @property
    def row_ids(self) -> torch.Tensor:
        return self._row_ids

    @property
    def num_rows(self) -> int:
        return int(self._mask_BR.shape[0])

    def to_batch(self, values: torch.Tensor) -> torch.Tensor:
        micro = self._micro
        if values.shape != (micro.out_len,):
            raise ValueError(f"a loss context reads this rank's head outputs [{micro.out_len}]; got {tuple(values.shape)}")
        stream_T = micro.gather(values.detach().contiguous()).cpu()  # collective over the shard groups
        rows_BR = stream_to_response(stream_T, micro.packed, micro.prompt_len, micro.response_len)
        return rows_BR[self._mask_BR].to(self._device)

    def from_batch(self, values_N: torch.Tensor) -> torch.Tensor:
        rows_BR = torch.zeros(self._mask_BR.shape, dtype=values_N.dtype)
        rows_BR[self._mask_BR] = values_N.detach().cpu()
        return self._micro.response_values_local(rows_BR).to(self._device)
