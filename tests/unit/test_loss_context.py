"""Loss contexts: the row and micro-batch statistics a policy loss reads, by hand on padded rows, and the
actor's micro-batch context on a packed stream equal to them (one rank; sharded layouts are
tests/distributed/test_policy_loss_layouts.py)."""

from __future__ import annotations

import pytest
import torch

from rlsp.algos.loss_context import RowContext, context_or_rows
from rlsp.data.batch import Batch
from rlsp.engine.micro import prepare_micro_batch
from rlsp.engine.stream import stream_to_response
from rlsp.workers.loss_context import MicroBatchContext

F64 = torch.float64
MASK = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=F64)
VALUES = torch.tensor([[1.0, 2.0, 99.0, 99.0], [99.0, 99.0, 99.0, 99.0], [3.0, -1.0, 0.5, 0.5], [7.0, float("nan"), 0, 0]],
                      dtype=F64)


def test_row_context_statistics_by_hand() -> None:
    ctx = RowContext(MASK)
    assert ctx.num_rows == 4 and ctx.batch_tokens() == 7
    assert ctx.row_ids.tolist() == [0, 0, 2, 2, 2, 2, 3]
    assert ctx.to_batch(VALUES).tolist() == [1.0, 2.0, 3.0, -1.0, 0.5, 0.5, 7.0]  # masked slots never read
    want_sum = [[3.0, 3.0, 0, 0], [0, 0, 0, 0], [3.0] * 4, [7.0, 0, 0, 0]]
    torch.testing.assert_close(ctx.row_sum(VALUES), torch.tensor(want_sum, dtype=F64), rtol=0, atol=0)
    want_n = [[2.0, 2.0, 0, 0], [0, 0, 0, 0], [4.0] * 4, [1.0, 0, 0, 0]]
    torch.testing.assert_close(ctx.row_tokens(VALUES), torch.tensor(want_n, dtype=F64), rtol=0, atol=0)
    want_mean = [[1.5, 1.5, 0, 0], [0, 0, 0, 0], [0.75] * 4, [7.0, 0, 0, 0]]
    torch.testing.assert_close(ctx.row_mean(VALUES), torch.tensor(want_mean, dtype=F64), rtol=0, atol=0)
    assert ctx.batch_sum(VALUES).item() == 13.0


def test_context_results_are_detached_and_rows_are_required() -> None:
    values = VALUES.clone().requires_grad_(True)
    ctx = context_or_rows(None, MASK)
    assert not ctx.row_sum(values).requires_grad and not ctx.batch_sum(values).requires_grad
    with pytest.raises(ValueError, match="needs rows"):
        RowContext(MASK.reshape(-1))
    with pytest.raises(ValueError, match="values shape"):
        ctx.to_batch(VALUES[:, :3])


def _packed_rows() -> Batch:
    """Left-padded prompts (width 3) and the responses of MASK (width 4), as the actor's micro-batches hold them."""
    B, P, R = 4, 3, 4
    attention = torch.zeros(B, P + R, dtype=torch.long)
    for b in range(B):
        attention[b, P - 1 - b % 3 : P] = 1
        attention[b, P : P + int(MASK[b].sum())] = 1
    ids = torch.arange(1, B * (P + R) + 1).reshape(B, P + R) * attention
    return Batch.from_dict({"input_ids": ids, "attention_mask": attention, "response_mask": MASK.float()})


def test_micro_batch_context_on_a_packed_stream_equals_the_rows() -> None:
    rows = _packed_rows()
    micro = prepare_micro_batch(rows, 3, None, num_q_heads=2, num_kv_heads=1)
    ctx = MicroBatchContext(micro, torch.device("cpu"))
    local = micro.response_values_local(torch.nan_to_num(VALUES) * MASK)  # the loss's tokens [S]
    assert local.shape == (micro.out_len,)
    rows_ctx = RowContext(MASK)
    assert ctx.num_rows == 4 and ctx.batch_tokens() == 7 and ctx.row_ids.tolist() == rows_ctx.row_ids.tolist()
    assert ctx.to_batch(local).tolist() == rows_ctx.to_batch(VALUES).tolist()
    for stat in ("row_sum", "row_mean"):
        got_BR = stream_to_response(getattr(ctx, stat)(local), micro.packed, 3, 4)
        torch.testing.assert_close(got_BR, getattr(rows_ctx, stat)(VALUES), rtol=0, atol=0)
    got_BR = stream_to_response(ctx.row_tokens(local), micro.packed, 3, 4)
    torch.testing.assert_close(got_BR, rows_ctx.row_tokens(VALUES), rtol=0, atol=0)
    assert ctx.batch_sum(local).item() == 13.0
    with pytest.raises(ValueError, match="head outputs"):
        ctx.to_batch(local[:-1])
