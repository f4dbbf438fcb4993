"""Explicit block math of ring attention: masked fp32 (fp64) scores of one box, a tile of query rows at
a time. It is the reference the fused kernels (rlsp/parallel/ring_block.py) are tested against, and
the fallback ring attention takes for a dtype the device's fused kernel lacks (fp64 on CUDA).

Peak per tile: about 3 * hq * rows * K * 4 bytes (scores, probabilities, their gradient), rows at most
`row_chunk` of the box; masks are derived from the box's 1-D positions per tile.

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


def block_attention(q_QHD: torch.Tensor, k_KHD: torch.Tensor, v_KHD: torch.Tensor, mask_QK: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention of one block (k/v already with hq heads) -> (o [Q, H, D], lse [H, Q]).

    Accumulates in fp32 (fp64 for fp64 inputs) and returns that dtype. A row without visible keys
    gets o = 0 and lse = -inf.
    """
    acc = acc_dtype(q_QHD.dtype)
    scores_HQK = torch.einsum("qhd,khd->hqk", q_QHD.to(acc), k_KHD.to(acc)) * scale
    scores_HQK = scores_HQK.masked_fill(~mask_QK, float("-inf"))
    lse_HQ = torch.logsumexp(scores_HQK, dim=-1)
    probs_HQK = torch.exp(scores_HQK - finite(lse_HQ)[..., None])
    return torch.einsum("hqk,khd->qhd", probs_HQK, v_KHD.to(acc)), lse_HQ


def block_attention_backward(do_QHD: torch.Tensor, q_QHD: torch.Tensor, k_KHD: torch.Tensor, v_KHD: torch.Tensor,
                             mask_QK: torch.Tensor, scale: float, lse_HQ: torch.Tensor,
                             delta_HQ: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of one block given the FINAL lse and delta = rowsum(dO * O) of the rows.

    Returns fp32 (fp64) tensors shaped like q, k, v (k/v with hq heads).
    """
    acc = acc_dtype(q_QHD.dtype)
    q, k, v, do = (x.to(acc) for x in (q_QHD, k_KHD, v_KHD, do_QHD))
    scores_HQK = torch.einsum("qhd,khd->hqk", q, k) * scale
    probs_HQK = torch.exp(scores_HQK.masked_fill(~mask_QK, float("-inf")) - finite(lse_HQ)[..., None])
    dv_KHD = torch.einsum("hqk,qhd->khd", probs_HQK, do)
    dprobs_HQK = torch.einsum("qhd,khd->hqk", do, v)
    dscores_HQK = probs_HQK * (dprobs_HQK - delta_HQ[..., None]) * scale
    return torch.einsum("hqk,khd->qhd", dscores_HQK, k), torch.einsum("hqk,qhd->khd", dscores_HQK, q), dv_KHD


def attend_box(q_QHD: torch.Tensor, k_KHD: torch.Tensor, v_KHD: torch.Tensor, block: StepBlock, scale: float,
               row_chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_attention` over one box, `row_chunk` query rows at a time (rows are independent)."""
    parts = [block_attention(q_QHD[r0:r0 + row_chunk], k_KHD, v_KHD, block.mask(r0, r0 + row_chunk), scale)
             for r0 in range(0, q_QHD.shape[0], row_chunk)]
    return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts], dim=1)


def attend_box_backward(do_QHD: torch.Tensor, q_QHD: torch.Tensor, k_KHD: torch.Tensor, v_KHD: torch.Tensor,
                        block: StepBlock, scale: float, lse_HQ: torch.Tensor, delta_HQ: torch.Tensor,
                        row_chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`block_attention_backward` over one box in row chunks: dq per chunk, dk/dv summed over chunks."""
    dqs, dk_KHD, dv_KHD = [], None, None
    for r0 in range(0, q_QHD.shape[0], row_chunk):
        rows = slice(r0, r0 + row_chunk)
        dq, dk, dv = block_attention_backward(do_QHD[rows], q_QHD[rows], k_KHD, v_KHD, block.mask(r0, r0 + row_chunk),
                                              scale, lse_HQ[:, rows], delta_HQ[:, rows])
        dqs.append(dq)
        dk_KHD, dv_KHD = (dk, dv) if dk_KHD is None else (dk_KHD + dk, dv_KHD + dv)
    return torch.cat(dqs), dk_KHD, dv_KHD
