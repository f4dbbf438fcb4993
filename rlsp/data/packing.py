"""Pack padded rows into one token stream (varlen, cu_seqlens) and scatter per-token values back.

Training never runs on padded rows: a micro-batch [B, L] whose rows may be left- and right-padded
is flattened into a single stream of the real tokens, row after row, followed by a padding tail so
that the stream length is a multiple of the sequence-parallel size. Labels (the next token of the
same sequence) are computed here, on the full stream, *before* any sequence-parallel slicing, so a
shard boundary that cuts a sequence never loses a label.

Legend: B rows, L row width, T packed stream length (multiple of `pad_to_multiple`), T_real number
of real tokens (T_real <= T), N number of segments in `cu_seqlens` (non-empty rows + padding tail).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedBatch:
    """One packed micro-batch.

    input_ids / position_ids / labels / label_mask are [T]. The first T_real entries are the real
    tokens in row-major order; the last `num_pad` entries are padding (input id 0, positions
    0..num_pad-1 so the tail is a well-formed segment of its own, labels masked).
    `cu_seqlens` [N+1] int32 delimits the segments of the whole stream: one per non-empty row, then
    the padding tail if `num_pad > 0`. Empty rows contribute no segment.
    `seq_lens` has one entry per row (B entries, 0 for an empty row) in stream order.
    `row_index` / `col_index` [T_real] give the row and column each real stream token came from.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    label_mask: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_lens: list[int]
    num_pad: int
    row_index: torch.Tensor
    col_index: torch.Tensor
    batch_shape: tuple[int, int]

    @property
    def total_len(self) -> int:
        """T: stream length including the padding tail."""
        return int(self.input_ids.shape[0])

    @property
    def num_real(self) -> int:
        """T_real: number of real (non-padding) tokens."""
        return int(self.row_index.shape[0])

    @property
    def max_seqlen(self) -> int:
        """Longest segment of the stream (padding tail included), as flash-attn varlen wants it."""
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max().item())


def _check_contiguous_rows(attention_mask_BL: torch.Tensor) -> torch.Tensor:
    """Return per-row real-token counts; raise if a row's real tokens are not contiguous."""
    mask_BL = attention_mask_BL.to(torch.bool)
    lens_B = mask_BL.sum(dim=1)
    # A contiguous run of ones has exactly one 0->1 rising edge (or none if the row is empty).
    padded_BL = torch.nn.functional.pad(mask_BL.to(torch.int8), (1, 0))
    rises_B = (padded_BL[:, 1:] - padded_BL[:, :-1] == 1).sum(dim=1)
    bad = ((lens_B > 0) & (rises_B != 1)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"attention_mask rows {bad} have non-contiguous real tokens; each row must be "
            "[left padding][real tokens][right padding]"
        )
    return lens_B


def pack_sequences(
    input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor, pad_to_multiple: int = 1
) -> PackedBatch:
    """Flatten the real tokens of every row into one stream padded to a multiple of `pad_to_multiple`.

    The stream is never empty: a micro-batch without real tokens becomes `pad_to_multiple` padding
    tokens, so every sequence-parallel rank still receives a (pure padding) shard.
    """
    if input_ids_BL.dim() != 2 or input_ids_BL.shape != attention_mask_BL.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids_BL.shape)} and attention_mask {tuple(attention_mask_BL.shape)} "
            "must both be [B, L]"
        )
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple={pad_to_multiple}; it must be >= 1 (the sp size)")
    B, L = input_ids_BL.shape
    device = input_ids_BL.device
    lens_B = _check_contiguous_rows(attention_mask_BL)
    row_index, col_index = attention_mask_BL.to(torch.bool).nonzero(as_tuple=True)
    n_real = int(row_index.shape[0])
    total = max(-(-n_real // pad_to_multiple) * pad_to_multiple, pad_to_multiple)
    num_pad = total - n_real

    seg_lens = [int(n) for n in lens_B.tolist() if n > 0] + ([num_pad] if num_pad > 0 else [])
    seg_lens_N = torch.tensor(seg_lens, dtype=torch.int64, device=device)
    cu_seqlens = torch.zeros(len(seg_lens) + 1, dtype=torch.int32, device=device)
    cu_seqlens[1:] = torch.cumsum(seg_lens_N, dim=0).to(torch.int32)

    # Position restarts at 0 in every segment: index minus the start of the token's segment.
    starts_T = torch.repeat_interleave(cu_seqlens[:-1].to(torch.int64), seg_lens_N)
    position_ids = torch.arange(total, device=device) - starts_T

    input_ids = torch.zeros(total, dtype=torch.int64, device=device)
    input_ids[:n_real] = input_ids_BL[row_index, col_index].to(torch.int64)
    # Next token of the same sequence: shift left by one; the last token of a segment has none.
    ends_T = torch.repeat_interleave(cu_seqlens[1:].to(torch.int64), seg_lens_N)
    label_mask = torch.arange(total, device=device) + 1 < ends_T
    label_mask[n_real:] = False
    labels = torch.zeros(total, dtype=torch.int64, device=device)
    labels[:-1] = input_ids[1:]
    labels = torch.where(label_mask, labels, torch.zeros_like(labels))

    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        labels=labels,
        label_mask=label_mask,
        cu_seqlens=cu_seqlens,
        seq_lens=[int(n) for n in lens_B.tolist()],
        num_pad=num_pad,
        row_index=row_index,
        col_index=col_index,
        batch_shape=(B, L),
    )


def unpack_to_rows(values_T: torch.Tensor, packed: PackedBatch, fill: float = 0.0) -> torch.Tensor:
    """Scatter per-token stream values [T, ...] back to [B, L, ...]; `fill` where a row has no token.

    Differentiable: gradients flow back to the real-token entries of `values_T`.
    """
    if values_T.shape[0] != packed.total_len:
        raise ValueError(f"values have {values_T.shape[0]} tokens, the packed stream has {packed.total_len}")
    B, L = packed.batch_shape
    out_BL = values_T.new_full((B, L, *values_T.shape[1:]), fill)
    return out_BL.index_put((packed.row_index, packed.col_index), values_T[: packed.num_real])


def pack_values(values_BL: torch.Tensor, packed: PackedBatch, fill: float = 0.0) -> torch.Tensor:
    """Gather per-position row values [B, L, ...] into stream order [T, ...]; `fill` on the padding tail."""
    if tuple(values_BL.shape[:2]) != tuple(packed.batch_shape):
        raise ValueError(f"values are {tuple(values_BL.shape[:2])}, the packed batch is {packed.batch_shape}")
    out_T = values_BL.new_full((packed.total_len, *values_BL.shape[2:]), fill)
    out_T[: packed.num_real] = values_BL[packed.row_index, packed.col_index]
    return out_T
