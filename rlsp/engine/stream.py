"""Move per-response values between padded rows [B, R] and a packed token stream [T].

Legend: B rows, P prompt width (left-padded), R response width, L = P + R, T packed stream length.
The value computed at stream position t (a logprob of the *next* token) belongs to the response
token j of row b when t holds column P-1+j of row b. A sequence score (a reward model's) is the value
at the row's last real token.
"""

from __future__ import annotations

import torch

from rlsp.data.packing import PackedBatch, pack_values, unpack_to_rows


def response_to_stream(values_BR: torch.Tensor, packed: PackedBatch, prompt_len: int) -> torch.Tensor:
    """Place response values at the stream positions that predict them; zeros elsewhere."""
    B, R = values_BR.shape
    L = packed.batch_shape[1]
    if L - prompt_len != R:
        raise ValueError(f"rows are {L} wide with prompt width {prompt_len}; response values must be [B, {L - prompt_len}], got {R}")
    aligned_BL = values_BR.new_zeros((B, L))
    aligned_BL[:, prompt_len - 1 : prompt_len - 1 + R] = values_BR
    return pack_values(aligned_BL, packed)


def stream_to_response(values_T: torch.Tensor, packed: PackedBatch, prompt_len: int, response_len: int) -> torch.Tensor:
    rows_BL = unpack_to_rows(values_T, packed)
    return rows_BL[:, prompt_len - 1 : prompt_len - 1 + response_len]


def stream_to_last_token(values_T: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """The value at each row's last real token, [B] (0 for a row without tokens): a sequence score."""
    ends = torch.tensor(packed.seq_lens).cumsum(0) - 1  # stream position of each row's last token
    has_tokens = torch.tensor(packed.seq_lens) > 0
    return torch.where(has_tokens, values_T[ends.clamp_min(0)], torch.zeros((), dtype=values_T.dtype))
