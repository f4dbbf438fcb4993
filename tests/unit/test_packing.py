"""Packing padded rows into a token stream: layout, labels rolled within sequences, round trips."""

from __future__ import annotations

import pytest
import torch

from rlsp.data.packing import pack_sequences, pack_values, unpack_to_rows


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Row 0 left+right padded, row 1 full, row 2 empty, row 3 left padded."""
    ids_BL = torch.tensor(
        [
            [0, 11, 12, 13, 0, 0],
            [21, 22, 23, 24, 25, 26],
            [0, 0, 0, 0, 0, 0],
            [0, 0, 0, 0, 41, 42],
        ]
    )
    mask_BL = torch.tensor(
        [
            [0, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0, 0],
            [0, 0, 0, 0, 1, 1],
        ]
    )
    return ids_BL, mask_BL


def test_stream_layout_labels_and_cu_seqlens() -> None:
    packed = pack_sequences(*_rows(), pad_to_multiple=4)
    assert packed.input_ids.tolist() == [11, 12, 13, 21, 22, 23, 24, 25, 26, 41, 42, 0]
    assert packed.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1, 0]
    assert packed.labels.tolist() == [12, 13, 0, 22, 23, 24, 25, 26, 0, 42, 0, 0]
    assert packed.label_mask.tolist() == [True, True, False] + [True] * 5 + [False, True, False, False]
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == [0, 3, 9, 11, 12]  # empty row: no segment; pad tail: own segment
    assert packed.seq_lens == [3, 6, 0, 2]
    assert packed.num_pad == 1 and packed.total_len == 12 and packed.num_real == 11
    assert packed.max_seqlen == 6
    assert packed.row_index.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1, 3, 3]
    assert packed.col_index.tolist() == [1, 2, 3, 0, 1, 2, 3, 4, 5, 4, 5]
    assert packed.batch_shape == (4, 6)


def test_labels_are_rolled_before_slicing() -> None:
    """A shard boundary inside a sequence keeps the label that crosses it (labels live on the full stream)."""
    packed = pack_sequences(*_rows(), pad_to_multiple=4)
    shard0 = slice(0, 6)  # sp=2 cuts row 1 between tokens 23 and 24
    assert packed.labels[shard0][-1].item() == 24 and packed.label_mask[shard0][-1].item()


def test_padding_multiples_and_no_padding() -> None:
    ids_BL, mask_BL = _rows()
    for multiple in (1, 2, 3, 5, 8):
        packed = pack_sequences(ids_BL, mask_BL, pad_to_multiple=multiple)
        assert packed.total_len % multiple == 0 and packed.total_len - packed.num_pad == 11
        assert not packed.label_mask[11:].any()
    assert pack_sequences(ids_BL, mask_BL, 1).cu_seqlens.tolist() == [0, 3, 9, 11]


def test_all_empty_or_fewer_tokens_than_sp() -> None:
    empty = pack_sequences(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64), 4)
    assert empty.total_len == 4 and empty.num_real == 0 and empty.cu_seqlens.tolist() == [0, 4]
    assert empty.position_ids.tolist() == [0, 1, 2, 3] and not empty.label_mask.any()
    tiny = pack_sequences(torch.tensor([[5, 6]]), torch.tensor([[0, 1]]), 4)
    assert tiny.input_ids.tolist() == [6, 0, 0, 0] and tiny.cu_seqlens.tolist() == [0, 1, 4]


def test_unpack_round_trip_and_gradient() -> None:
    ids_BL, mask_BL = _rows()
    packed = pack_sequences(ids_BL, mask_BL, pad_to_multiple=4)
    back_BL = unpack_to_rows(packed.input_ids, packed, fill=-1)
    assert torch.equal(back_BL, torch.where(mask_BL.bool(), ids_BL, torch.full_like(ids_BL, -1)))
    values_BL = torch.randn(4, 6, dtype=torch.float64)
    stream_T = pack_values(values_BL, packed)
    assert torch.equal(unpack_to_rows(stream_T, packed), values_BL * mask_BL)
    x_T = torch.randn(packed.total_len, dtype=torch.float64, requires_grad=True)
    (unpack_to_rows(x_T, packed) * values_BL).sum().backward()
    expected_T = torch.cat(
        [values_BL[packed.row_index, packed.col_index], torch.zeros(packed.num_pad, dtype=torch.float64)]
    )
    assert torch.equal(x_T.grad, expected_T)


def test_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="non-contiguous"):
        pack_sequences(torch.ones(1, 4, dtype=torch.int64), torch.tensor([[1, 0, 1, 1]]))
    with pytest.raises(ValueError, match="pad_to_multiple"):
        pack_sequences(torch.ones(1, 4, dtype=torch.int64), torch.ones(1, 4, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        pack_sequences(torch.ones(4, dtype=torch.int64), torch.ones(4, dtype=torch.int64))
