"""Token logprobs (and entropy) from final hidden states without materialising all [T, V] logits.

Tokens are processed in chunks of C; each chunk's logits are computed, upcast to fp32 (fp64 stays
fp64) and reduced to one logprob (and entropy) per token. The backward is written out (a custom
autograd function) instead of recorded: it recomputes each chunk's logits from the saved inputs and
forms the logit gradient in place, g_lp * (onehot - p) - g_ent * p * (log p + H), then two matmuls.
Only the inputs and two fp32 numbers per token (logsumexp, entropy) are kept for backward, so peak
extra memory is O(C * V) in forward and backward instead of O(T * V): one fp32 [C, V] buffer per chunk
(forward: the logits, reduced 128 rows at a time; backward: the logit gradient formed in place, plus
the probabilities when the entropy is in the loss), touched a few times per chunk instead of once
per recorded op. An output the loss does not use gets no gradient work.

`compute_token_logprobs_sum_pi_squared` is the no-gradient variant for the old-logprob pass that also
returns sum_v p_v^2 per token (the optimal token baseline's path variance, verl's sum_pi_squared), from
the same chunk of logits: exact per token, so any sequence sharding gives the unsharded values.

`compiled=True` (verl's `use_torch_compile`) runs the forward's per-block entropy (logsumexp and
sum_v p_v * logit_v of a [128, V] block) through torch.compile, as verl compiles its entropy from logits;
the logprobs, the sum of p^2 and the written-out backward stay eager. Same values to fp32 rounding.

Legend: T tokens, H hidden size, V vocabulary size, C chunk length.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


def _chunk_logits(hidden_CH: torch.Tensor, weight_VH: torch.Tensor, temperature: float,
                  softcap: float | None = None) -> torch.Tensor:
    # the matmul runs in the model dtype; the reductions in at least fp32 (fp64 stays fp64)
    logits_CV = (hidden_CH @ weight_VH.t()).to(torch.promote_types(hidden_CH.dtype, torch.float32))
    if softcap is not None:  # Gemma 2's final-logit soft-capping, before the temperature (as generate applies it)
        logits_CV = logits_CV.div_(softcap).tanh_().mul_(softcap)
    return logits_CV if temperature == 1.0 else logits_CV.div_(temperature)


_ROWS = 128  # rows per reduction block of a chunk: logsumexp's and softmax's temporaries stay [128, V]


def _block_entropy(block_RV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logsumexp, entropy) of each row of a [R, V] block of logits."""
    lse_R = torch.logsumexp(block_RV, dim=-1)
    p_RV = (block_RV - lse_R[:, None]).exp()
    return lse_R, lse_R - torch.linalg.vecdot(p_RV, block_RV)


@functools.cache
def compiled_block_entropy() -> Any:
    """`_block_entropy` through torch.compile (inductor; dynamic shapes: one graph for every block size), run
    once on a probe block so a platform where compiling fails says so where the head is built (RuntimeError
    naming the way out) instead of in the first training step."""
    fn = torch.compile(_block_entropy, dynamic=True)
    try:
        fn(torch.zeros(3, 5))
    except Exception as exc:  # inductor raises many types (no C++ compiler, unsupported platform, ...)
        raise RuntimeError(f"torch.compile of the entropy head failed ({type(exc).__name__}: {str(exc)[:300]}); "
                           "set actor_rollout_ref.actor.use_torch_compile=false (and ref.use_torch_compile) to run "
                           "it eagerly") from exc
    return fn


def _reduce_rows(logits_CV: torch.Tensor, entropy_C: torch.Tensor | None, compiled: bool = False) -> torch.Tensor:
    """Row-wise logsumexp of a chunk's logits (returned) and, into `entropy_C`, H = lse - sum_v p_v * logit_v,
    _ROWS rows at a time so no temporary of the chunk's full [C, V] size is allocated."""
    lse_C = logits_CV.new_empty(logits_CV.shape[0])
    block_entropy = compiled_block_entropy() if compiled else _block_entropy
    for r0 in range(0, logits_CV.shape[0], _ROWS):
        block_RV = logits_CV[r0:r0 + _ROWS]
        if entropy_C is None:
            lse_C[r0:r0 + _ROWS] = torch.logsumexp(block_RV, dim=-1)
        else:
            lse_C[r0:r0 + _ROWS], entropy_C[r0:r0 + _ROWS] = block_entropy(block_RV)
    return lse_C


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden_TH: torch.Tensor, weight_VH: torch.Tensor, labels_T: torch.Tensor,
                temperature: float, chunk_size: int, with_entropy: bool,
                compiled: bool = False, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        T = hidden_TH.shape[0]
        out_dtype = torch.promote_types(hidden_TH.dtype, torch.float32)
        logprobs_T = hidden_TH.new_empty((T,), dtype=out_dtype)
        lse_T = hidden_TH.new_empty((T,), dtype=out_dtype)
        entropy_T = hidden_TH.new_zeros((T if with_entropy else 0,), dtype=out_dtype)
        for start in range(0, T, chunk_size):
            end = min(start + chunk_size, T)
            logits_CV = _chunk_logits(hidden_TH[start:end], weight_VH, temperature, softcap)
            lse_C = _reduce_rows(logits_CV, entropy_T[start:end] if with_entropy else None, compiled)
            lse_T[start:end] = lse_C
            logprobs_T[start:end] = logits_CV.gather(-1, labels_T[start:end, None])[:, 0] - lse_C
            del logits_CV
        ctx.save_for_backward(hidden_TH, weight_VH, labels_T, lse_T, entropy_T)
        ctx.settings = (temperature, chunk_size, with_entropy, softcap)
        # An output the loss does not use (the entropy when only reported as a metric) then arrives as
        # None in backward instead of zeros, and its part of the logit gradient is skipped.
        ctx.set_materialize_grads(False)
        return logprobs_T, entropy_T

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g_lp_T: torch.Tensor, g_ent_T: torch.Tensor) -> tuple[Any, ...]:
        hidden_TH, weight_VH, labels_T, lse_T, entropy_T = ctx.saved_tensors
        temperature, chunk_size, with_entropy, softcap = ctx.settings
        need_h, need_w = ctx.needs_input_grad[:2]
        entropy_grad = with_entropy and g_ent_T is not None
        if g_lp_T is None:
            if not entropy_grad:
                return None, None, None, None, None, None, None, None
            g_lp_T = torch.zeros_like(lse_T)
        grad_h = torch.empty_like(hidden_TH) if need_h else None
        grad_w = torch.zeros_like(weight_VH) if need_w else None
        for start in range(0, hidden_TH.shape[0], chunk_size):
            end = min(start + chunk_size, hidden_TH.shape[0])
            h_CH, g_lp_C = hidden_TH[start:end], g_lp_T[start:end]
            logp_CV = _chunk_logits(h_CH, weight_VH, temperature, softcap)
            # d(cap * tanh(z / cap))/dz = 1 - tanh^2, tanh = capped logit * temperature / cap
            dcap_CV = None if softcap is None else (logp_CV * (temperature / softcap)).square_().neg_().add_(1.0)
            logp_CV.sub_(lse_T[start:end, None])
            if entropy_grad:  # dH/dz = -p * (log p + H): two [C, V] buffers
                p_CV = logp_CV.exp()
                coef_CV = logp_CV.add_(entropy_T[start:end, None]).mul_(g_ent_T[start:end, None]).add_(g_lp_C[:, None])
                grad_z_CV = p_CV.mul_(coef_CV).neg_()  # d lp/dz = onehot - p
                del p_CV, coef_CV
            else:  # logprobs alone: p is computed in place, one [C, V] buffer
                grad_z_CV = logp_CV.exp_().mul_(g_lp_C[:, None]).neg_()
            del logp_CV
            grad_z_CV.scatter_add_(-1, labels_T[start:end, None], g_lp_C[:, None].to(grad_z_CV.dtype))
            if temperature != 1.0:
                grad_z_CV.div_(temperature)
            if dcap_CV is not None:
                grad_z_CV.mul_(dcap_CV)
                del dcap_CV
            grad_z_CV = grad_z_CV.to(hidden_TH.dtype)
            if need_h:
                torch.mm(grad_z_CV, weight_VH, out=grad_h[start:end])
            if need_w:
                grad_w.addmm_(grad_z_CV.t(), h_CH)
            del grad_z_CV  # nothing of this chunk stays alive while the next one is computed
        return grad_h, grad_w, None, None, None, None, None, None


def _check_head_inputs(hidden_TH: torch.Tensor, weight_VH: torch.Tensor, labels_T: torch.Tensor,
                       temperature: float, chunk_size: int) -> None:
    if hidden_TH.dim() != 2 or weight_VH.dim() != 2 or hidden_TH.shape[1] != weight_VH.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden_TH.shape)} and weight {tuple(weight_VH.shape)} must be [T, H] and [V, H]"
        )
    if labels_T.shape != hidden_TH.shape[:1]:
        raise ValueError(f"labels {tuple(labels_T.shape)} must be [T={hidden_TH.shape[0]}]")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}; it must be > 0")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}; it must be >= 1")


def compute_token_logprobs(
    hidden_TH: torch.Tensor,
    weight_VH: torch.Tensor,
    labels_T: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    compiled: bool = False,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(hidden @ weight.T / temperature)[label] per token; entropy of the same
    distribution when `with_entropy` (else None). `softcap`: the logits are first soft-capped,
    cap * tanh(logits / cap) (config.final_logit_softcapping; the gradient includes the tanh's derivative). Outputs are fp32 (fp64 for fp64 inputs); the
    matmul runs in the model dtype. Exact: equal to the naive full-logits computation. `compiled`: the
    entropy's per-block reduction through torch.compile (module docstring)."""
    _check_head_inputs(hidden_TH, weight_VH, labels_T, temperature, chunk_size)
    logprobs_T, entropy_T = _ChunkedLogprobs.apply(
        hidden_TH, weight_VH, labels_T.to(torch.int64), float(temperature), int(chunk_size), with_entropy,
        bool(compiled and with_entropy), None if softcap is None else float(softcap),
    )
    return logprobs_T, (entropy_T if with_entropy else None)


@torch.no_grad()
def compute_token_logprobs_sum_pi_squared(
    hidden_TH: torch.Tensor, weight_VH: torch.Tensor, labels_T: torch.Tensor, *, temperature: float = 1.0,
    chunk_size: int = 1024, softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs_T, sum_pi_squared_T): as `compute_token_logprobs` (no gradient), plus sum_v p_v^2 of the
    same temperature-scaled distribution per token, one [C, V] chunk of logits at a time."""
    _check_head_inputs(hidden_TH, weight_VH, labels_T, temperature, chunk_size)
    out_dtype = torch.promote_types(hidden_TH.dtype, torch.float32)
    T = hidden_TH.shape[0]
    logprobs_T = hidden_TH.new_empty((T,), dtype=out_dtype)
    sum_sq_T = hidden_TH.new_empty((T,), dtype=out_dtype)
    labels_T = labels_T.to(torch.int64)
    for start in range(0, T, chunk_size):
        end = min(start + chunk_size, T)
        logits_CV = _chunk_logits(hidden_TH[start:end], weight_VH, temperature, softcap)
        for r0 in range(0, end - start, _ROWS):  # [128, V] temporaries, as in _reduce_rows
            block_RV = logits_CV[r0:r0 + _ROWS]
            rows = slice(start + r0, start + r0 + block_RV.shape[0])
            lse_R = torch.logsumexp(block_RV, dim=-1)
            logprobs_T[rows] = block_RV.gather(-1, labels_T[rows, None])[:, 0] - lse_R
            # p^2 = exp(2 (logit - lse)) straight from the log-probabilities
            sum_sq_T[rows] = (block_RV - lse_R[:, None]).mul_(2.0).exp_().sum(-1)
        del logits_CV
    return logprobs_T, sum_sq_T
