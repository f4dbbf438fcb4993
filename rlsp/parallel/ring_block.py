"""Fused attention of one ring-attention tile: output and log-sum-exp forward, and the flash backward
driven by the FINAL (merged) output and lse of the rows, which is exact blockwise: with the global
lse a tile's probabilities are the rows' true softmax restricted to the tile, and delta =
rowsum(dO * O) uses the true output, so per-tile dq/dk/dv sum to the full gradients.

A tile (rlsp/parallel/ring_tiles.py) is either fully visible or square and causal, so the kernels
run without a mask. Kernels, picked per device by `fused_supported`:
- CPU: aten `_scaled_dot_product_flash_attention_for_cpu` (+ `_backward`), fp32/fp64/bf16/fp16; it
  reads grouped kv heads itself (q head h reads kv head h // (hq // hkv)), so k/v are not expanded.
- CUDA: aten `_scaled_dot_product_efficient_attention` (+ `_backward`), fp32/bf16/fp16, equal head
  counts (k/v expanded by the caller); its lse is padded to a multiple of 32 rows.
Other devices and dtypes (fp64 on CUDA) take the explicit path (rlsp/parallel/ring_reference.py).
A v head dim other than q/k's (multi-latent attention: Dv != Dk) is taken by zero-padding the narrower side to
D = max(Dk, Dv) per tile (the CPU kernel wants one head dim): zero columns of q and k add nothing to the scores (the
scale is passed explicitly), zero columns of v give zero output columns, which are sliced off; in backward dO and O
are padded alike, so delta = rowsum(dO * O) and dq/dk/dv are unchanged and the pads' gradients are dropped.
Working set: O(Q x H x D) plus the kernel's own tiles, never Q x K scores.

Legend: Q / K query / key rows of one tile, H heads (hq for q, the kernel's kv heads for k/v), D head dim.
"""

from __future__ import annotations

import torch

_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_CUDA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LSE_ALIGN = 32  # rows the CUDA efficient kernel pads its lse to


def fused_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a fused kernel with lse serves this device and dtype (else: the explicit path)."""
    if device.type == "cpu":
        return dtype in _CPU_DTYPES
    return device.type == "cuda" and dtype in _CUDA_DTYPES


def native_gqa(device: torch.device) -> bool:
    """Whether the device's kernel reads grouped kv heads (hq a multiple of hkv) without expansion."""
    return device.type == "cpu"


def _bhld(x_LHD: torch.Tensor) -> torch.Tensor:
    """[L, H, D] -> the kernels' [1, H, L, D] (a view: the kernels take strided inputs, last dim dense)."""
    return x_LHD.transpose(0, 1).unsqueeze(0)


def _lhd(x_1HLD: torch.Tensor) -> torch.Tensor:
    return x_1HLD.squeeze(0).transpose(0, 1)


def _pad(x_LHD: torch.Tensor, dim: int) -> torch.Tensor:
    """x zero-padded on its head dim to `dim` (itself when it already has it)."""
    return x_LHD if x_LHD.shape[-1] == dim else torch.nn.functional.pad(x_LHD, (0, dim - x_LHD.shape[-1]))


def fused_forward(q_QHD: torch.Tensor, k_KHD: torch.Tensor, v_KHD: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (o [Q, hq, Dv] in q's dtype, lse [hq, Q] fp32 (fp64 for fp64 inputs)) of one tile."""
    dv, dim = v_KHD.shape[-1], max(q_QHD.shape[-1], v_KHD.shape[-1])
    q, k, v = (_bhld(_pad(x, dim)) for x in (q_QHD, k_KHD, v_KHD))
    if q_QHD.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    else:
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)
    return _lhd(out)[..., :dv], lse[0, :, :q_QHD.shape[0]]


def fused_backward(do_QHD: torch.Tensor, q_QHD: torch.Tensor, k_KHD: torch.Tensor, v_KHD: torch.Tensor,
                   out_QHD: torch.Tensor, lse_HQ: torch.Tensor, causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one tile, shaped like q, k, v, from the rows' final output and lse."""
    dk, dv = q_QHD.shape[-1], v_KHD.shape[-1]
    dim = max(dk, dv)
    q, k, v, do, out = (_bhld(_pad(x, dim)) for x in (q_QHD, k_KHD, v_KHD, do_QHD, out_QHD))
    if q_QHD.device.type == "cpu":
        lse = lse_HQ.to(torch.float64 if q.dtype == torch.float64 else torch.float32)[None]
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, causal, scale=scale)
    else:
        rows = lse_HQ.shape[1]
        lse = lse_HQ.new_zeros((1, lse_HQ.shape[0], -(-rows // _LSE_ALIGN) * _LSE_ALIGN), dtype=torch.float32)
        lse[0, :, :rows] = lse_HQ
        seed = torch.empty((), dtype=torch.int64, device=q.device)  # unused: no dropout
        grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            do, q, k, v, None, out, lse, seed, seed, 0.0, [True, True, True, False], causal, scale=scale)[:3]
    dq_QHD, dk_KHD, dv_KHD = (_lhd(g) for g in grads)
    return dq_QHD[..., :dk], dk_KHD[..., :dk], dv_KHD[..., :dv]
