"""Memory-lean RMSNorm: the same forward as HF's Llama / Qwen2 / Qwen3 / Mistral RMSNorm, with a
backward that recomputes the normalised value instead of keeping it (the norm Liger-style kernels
use, in plain torch so that it runs on CPU and CUDA).

HF's norm, out = weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype) with x32 = x.to(float32),
run under autograd keeps the fp32 copy x32 of the input ([..., H] fp32, 4 bytes per element), the
normalised value in the input dtype for the weight's gradient ([..., H], 2 bytes per element in
bf16, 4 in fp32; in fp32 it is the fp32 normalised value itself), the fp32 inverse RMS ([..., 1]) and
the weight: about 6 bytes per element in bf16, 8 in fp32. `LeanRMSNorm` keeps, per token, only

    the input x itself (H elements in its own dtype: 2 * H bytes in bf16, 4 * H in fp32 — the same
    tensor the previous op produced, not a copy) and the fp32 inverse RMS r (4 bytes),

plus a reference to the weight (shared with the model, no copy): 2 * H + 4 bytes per token in bf16,
4 * H + 4 in fp32, against HF's 6 * H + 4 in bf16 (x32 and the bf16 normalised value; HF does not keep
the bf16 input itself) and 8 * H + 4 in fp32 (the input, which is x32, and the normalised value): 4 * H
bytes per token less per norm in either dtype. Under activation checkpointing that is what a layer's
two norms hold while the layer is recomputed in backward (the first norm's input is the layer input,
which checkpointing keeps anyway; the second norm's, the residual after attention, is kept for it
alone). benchmarks/rmsnorm_memory.py measures it.

Forward (`_LeanRMSNormFunction`): HF's arithmetic in HF's order, so the output is bit-identical to
HF's module for fp32, bf16 and fp16 inputs (fp64 inputs are computed in fp64 instead of being
rounded to fp32 as HF does). Backward, in fp32 (fp64 for fp64 inputs), with y = x * r and
z = y.to(x.dtype) the value the weight multiplies:
    dz = (grad * weight).to(x.dtype)                          (rounded like autograd's mul backward)
    dx = r * (dz - y * mean(dz * y))  -> x.dtype            (d/dx of x * rsqrt(mean(x^2) + eps))
    dweight = sum over tokens of grad * z  -> weight.dtype

`apply_lean_rmsnorm(decoder)` swaps every RMSNorm module of a HF base model (each layer's input and
post-attention norms, the final norm, Qwen3's per-head q_norm / k_norm) for a `LeanRMSNorm` that takes
over the weight Parameter object under the same name, so parameter names (FSDP, LoRA, checkpoints,
weight sync) do not change. A norm that does not compute HF's function on two random tokens (Gemma's
`(1 + weight)` scale, a norm without a weight) is refused with an error naming the key to turn off.
Tensor parallelism (rlsp.parallel.tensor_parallel) runs the norms on DTensors: the input sharded along
the sequence (sequence parallel) or replicated, the weight replicated. The autograd function's ops are
then DTensor ops on the local shards (the hidden dim, the one the norm reduces over, is never split),
what it saves is the local input shard and the local inverse RMS, and the weight's gradient (with
sequence parallelism a Partial sum over the tp ranks' tokens) is reduced like the one autograd computes
through HF's norm (tests/distributed/test_lean_rmsnorm_engine.py runs tp 2 with and without it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

KEY = "lean_rmsnorm"  # the model config key that turns the swap on (named in errors)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """HF upcasts to fp32; an fp64 input keeps fp64 (so fp64 checks see fp64 precision)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _LeanRMSNormFunction(torch.autograd.Function):
    """weight * (x * rsqrt(mean(x^2) + eps)) with HF's casts; saves x and the fp32 inverse RMS only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.to(_compute_dtype(x.dtype))
        variance = x32.pow(2).mean(-1, keepdim=True)
        inv_rms = torch.rsqrt(variance + eps)
        ctx.save_for_backward(x, inv_rms, weight)
        return weight * (x32 * inv_rms).to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, inv_rms, weight = ctx.saved_tensors
        y = x.to(inv_rms.dtype) * inv_rms  # recomputed: the normalised value, bit-equal to the forward's
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            # autograd rounds the gradient reaching y.to(x.dtype) to x.dtype; do the same
            dz = (grad * weight).to(x.dtype).to(inv_rms.dtype)
            grad_x = (inv_rms * (dz - y * (dz * y).mean(-1, keepdim=True))).to(x.dtype)
        if ctx.needs_input_grad[1]:
            z = y.to(x.dtype).to(inv_rms.dtype)
            prod = grad.to(inv_rms.dtype) * z
            # summed over all leading dims (not reshaped: under tensor parallelism prod is a DTensor sharded
            # along the sequence, and the sum is then a Partial DTensor, as autograd's own weight gradient)
            grad_w = prod.sum(dim=tuple(range(prod.dim() - 1))).to(weight.dtype)
        return grad_x, grad_w, None


class LeanRMSNorm(nn.Module):
    """HF's RMSNorm with the memory-lean backward; `weight` is the replaced norm's Parameter object."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _LeanRMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def _is_rmsnorm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and not isinstance(module, LeanRMSNorm)


def _lean_copy(name: str, norm: nn.Module) -> LeanRMSNorm:
    """A `LeanRMSNorm` over `norm`'s weight, or a ValueError if `norm` is not shaped like HF's."""
    cls = type(norm).__name__
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    own = sorted(n for n, _ in [*norm.named_parameters(recurse=False), *norm.named_buffers(recurse=False)])
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or own != ["weight"] or list(norm.children()):
        raise ValueError(f"{name}: {cls} has tensors {own} and children {[n for n, _ in norm.named_children()]}; "
                         f"the lean RMSNorm needs exactly one 1-D `weight` parameter: set {KEY}=false for this model")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise ValueError(f"{name}: {cls} has epsilon {eps!r}, not a number: set {KEY}=false for this model")
    return LeanRMSNorm(weight, float(eps))


def _check_same_function(name: str, norm: nn.Module, lean: LeanRMSNorm, seed: int) -> None:
    """The model's own norm and the lean one must compute the same function (on two random tokens)."""
    weight = lean.weight
    if weight.device.type == "meta":
        return
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(2, weight.shape[0], generator=g)).to(weight.device, weight.dtype)
    with torch.no_grad():
        ours, theirs = lean(x), norm(x)
    # the dtype's default tolerance; fp64 at fp32's rounding, since HF computes fp64 norms in fp32
    tol = {"rtol": 1e-5, "atol": 1e-5} if weight.dtype == torch.float64 else {}
    try:
        torch.testing.assert_close(ours, theirs, **tol)
    except AssertionError as err:
        raise ValueError(
            f"{name}: {type(norm).__name__} is not weight * (x * rsqrt(mean(x^2) + eps)) (e.g. a Gemma-style "
            f"(1 + weight) scale); the lean RMSNorm does not support it (set {KEY}=false): {err}"
        ) from None


def apply_lean_rmsnorm(decoder: nn.Module) -> int:
    """Swap every RMSNorm module of `decoder` (a HF base model) for a `LeanRMSNorm`, in place, keeping
    each weight Parameter under its name; returns how many were swapped (a model without any is refused)."""
    found = [(name, module) for name, module in decoder.named_modules() if _is_rmsnorm(module)]
    if not found:
        kinds = sorted({type(m).__name__ for m in decoder.modules() if "norm" in type(m).__name__.lower()})
        raise ValueError(f"{type(decoder).__name__} has no RMSNorm modules (its norms: {kinds}); "
                         f"the lean RMSNorm replaces HF RMSNorms only: set {KEY}=false for this model")
    swaps = []
    for seed, (name, norm) in enumerate(found):  # check them all before changing anything
        lean = _lean_copy(name, norm)
        _check_same_function(name, norm, lean, seed)
        swaps.append((name, lean))
    for name, lean in swaps:
        parent_name, _, attr = name.rpartition(".")
        setattr(decoder.get_submodule(parent_name) if parent_name else decoder, attr, lean)
    return len(swaps)
