"""Explicit block math of ring attention: masked fp32 (fp64) scores of one box, a tile of query rows at
a time. It is the reference the fused kernels (rlsp/parallel/ring_block.py) are tested against, and
the fallback ring attention takes for a dtype the device's fused kernel lacks (fp64 on CUDA).

Peak per tile: about 3 * hq * rows * K * 4 bytes (scores, probabilities, their gradient), rows at most
`row_chunk` of the box; masks are derived from the box's 1-D positions per tile.

Sliding windows live in the box's mask (rlsp/parallel/ring_plan.py `StepBlock.mask`); a windowed box's row
chunk runs against its key band only (`StepBlock.key_band`), so its scores are rows x (window + rows), not
rows x K. Soft-capping (Gemma 2) maps each scaled score s to cap * tanh(s / cap) before the mask and the
softmax; its backward multiplies the capped scores' gradient by d/ds = 1 - tanh^2(s / cap).

Legend: Q / K query / key rows of one box, H heads (k/v already expanded to the q heads), D head dim.
"""

from __future__ import annotations

import torch

from rlsp.parallel.ring_plan import StepBlock


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of ring attention: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows without keys) replaced by 0, so exp(-inf - lse) is 0, never NaN."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _scores(q_QHD: torch.Tensor, k_KHD: torch.Tensor, scale: float,
            softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scaled, soft-capped scores [H, Q, K], tanh of the scaled scores / cap or None without soft-capping)."""
    scores_HQK = torch.einsum("qhd,khd->hqk", q_QHD, k_KHD) * scale
    if softcap is None:
        return scores_HQK, None
    tanh_HQK = torch.tanh(scores_HQK / softcap)
    return tanh_HQK * softcap, tanh_HQK


def block_attention(q_QHD: torch.Tensor, k_KHD: torch.Tensor, v_KHD: torch.Tensor, mask_QK: torch.Tensor,
                    scale: float, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention of one block (k/v already with hq heads) -> (o [Q, H, D], lse [H, Q]).

    Accumulates in fp32 (fp64 for fp64 inputs) and returns that dtype. A row without visible keys
    gets o = 0 and lse = -inf. `softcap`: scores -> softcap * tanh(scores / softcap) before the mask.
    """
    acc = acc_dtype(q_QHD.dtype)
    scores_HQK, _ = _scores(q_QHD.to(acc), k_KHD.to(acc), scale, softcap)
    scores_HQK = scores_HQK.masked_fill(~mask_QK, float("-inf"))
    lse_HQ = torch.logsumexp(scores_HQK, dim=-1)
    probs_HQK = torch.exp(scores_HQK - finite(lse_HQ)[..., None])
    return torch.einsum("hqk,khd->qhd", probs_HQK, v_KHD.to(acc)), lse_HQ


def block_attention_backward(do_QHD: torch.Tensor, q_QHD: torch.Tensor, k_KHD: torch.Tensor, v_KHD: torch.Tensor,
                             mask_QK: torch.Tensor, scale: float, lse_HQ: torch.Tensor,
                             delta_HQ: torch.Tensor,
                             softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of one block given the FINAL lse and delta = rowsum(dO * O) of the rows.

    Returns fp32 (fp64) tensors shaped like q, k, v (k/v with hq heads).
    """
    acc = acc_dtype(q_QHD.dtype)
    q, k, v, do = (x.to(acc) for x in (q_QHD, k_KHD, v_KHD, do_QHD))
    scores_HQK, tanh_HQK = _scores(q, k, scale, softcap)
    probs_HQK = torch.exp(scores_HQK.masked_fill(~mask_QK, float("-inf")) - finite(lse_HQ)[..., None])
    dv_KHD = torch.einsum("hqk,qhd->khd", probs_HQK, do)
    dprobs_HQK = torch.einsum("qhd,khd->hqk", do, v)
    dscores_HQK = probs_HQK * (dprobs_HQK - delta_HQ[..., None]) * scale
    if tanh_HQK is not None:  # d/ds softcap * tanh(s / softcap) = 1 - tanh^2(s / softcap)
        dscores_HQK = dscores_HQK * (1.0 - tanh_HQK * tanh_HQK)
    return torch.einsum("hqk,khd->qhd", dscores_HQK, k), torch.einsum("hqk,qhd->khd", dscores_HQK, q), dv_KHD


def attend_box(q_QHD: torch.Tensor, k_KHD: torch.Tensor, v_KHD: torch.Tensor, block: StepBlock, scale: float,
               row_chunk: int, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_attention` over one box, `row_chunk` query rows at a time (rows are independent), each chunk
    against its key band."""
    parts = []
    for r0 in range(0, q_QHD.shape[0], row_chunk):
        r1 = min(r0 + row_chunk, q_QHD.shape[0])
        a, b = block.key_band(r0, r1)
        parts.append(block_attention(q_QHD[r0:r1], k_KHD[a:b], v_KHD[a:b], block.mask(r0, r1, a, b), scale, softcap))
    return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts], dim=1)


def attend_box_backward(do_QHD: torch.Tensor, q_QHD: torch.Tensor, k_KHD: torch.Tensor, v_KHD: torch.Tensor,
                        block: StepBlock, scale: float, lse_HQ: torch.Tensor, delta_HQ: torch.Tensor,
                        row_chunk: int,
                        softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`block_attention_backward` over one box in row chunks (each against its key band): dq per chunk, dk/dv
    summed over chunks (fp32 / fp64, k/v with hq heads)."""
    acc = acc_dtype(q_QHD.dtype)
    dqs = []
    dk_KHD, dv_KHD = (x.new_zeros(x.shape, dtype=acc) for x in (k_KHD, v_KHD))
    for r0 in range(0, q_QHD.shape[0], row_chunk):
        r1 = min(r0 + row_chunk, q_QHD.shape[0])
        a, b = block.key_band(r0, r1)
        dq, dk, dv = block_attention_backward(do_QHD[r0:r1], q_QHD[r0:r1], k_KHD[a:b], v_KHD[a:b],
                                              block.mask(r0, r1, a, b), scale, lse_HQ[:, r0:r1], delta_HQ[:, r0:r1],
                                              softcap)
        dqs.append(dq)
        dk_KHD[a:b] += dk
        dv_KHD[a:b] += dv
    return torch.cat(dqs), dk_KHD, dv_KHD
