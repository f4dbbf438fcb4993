"""Token logprobs (and entropy) from final hidden states without materialising all [T, V] logits.

Tokens are processed in chunks; each chunk computes its logits, upcasts them to fp32 (fp64 stays
fp64) and reduces them to one logprob (and entropy) per token under `torch.utils.checkpoint`, so
only the chunk's inputs are kept for backward and its logits are recomputed there. Peak extra memory is
O(chunk_size * V) in forward and backward instead of O(T * V).

Legend: T tokens, H hidden size, V vocabulary size, C chunk length.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(
    hidden_CH: torch.Tensor, weight_VH: torch.Tensor, labels_C: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    # at least fp32 (bf16/fp16 models); fp64 stays fp64
    logits_CV = (hidden_CH @ weight_VH.t()).to(torch.promote_types(hidden_CH.dtype, torch.float32)) / temperature
    lse_C = torch.logsumexp(logits_CV, dim=-1)
    logprobs_C = logits_CV.gather(-1, labels_C.unsqueeze(-1)).squeeze(-1) - lse_C
    if not with_entropy:
        return logprobs_C, logprobs_C.new_zeros(())
    # H(p) = lse - sum_v p_v * logit_v, with p = softmax(logits)
    entropy_C = lse_C - (torch.softmax(logits_CV, dim=-1) * logits_CV).sum(dim=-1)
    return logprobs_C, entropy_C


def compute_token_logprobs(
    hidden_TH: torch.Tensor,
    weight_VH: torch.Tensor,
    labels_T: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(hidden @ weight.T / temperature)[label] per token; entropy of the same
    distribution when `with_entropy` (else None). Outputs are fp32 (fp64 for fp64 inputs); the
    matmul runs in the model dtype. Exact: equal to the naive full-logits computation."""
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
    labels_T = labels_T.to(torch.int64)
    logprob_chunks, entropy_chunks = [], []
    for start in range(0, hidden_TH.shape[0], chunk_size):
        end = min(start + chunk_size, hidden_TH.shape[0])
        args = (hidden_TH[start:end], weight_VH, labels_T[start:end], temperature, with_entropy)
        if torch.is_grad_enabled() and (hidden_TH.requires_grad or weight_VH.requires_grad):
            lp_C, ent_C = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            lp_C, ent_C = _chunk_logprobs(*args)
        logprob_chunks.append(lp_C)
        entropy_chunks.append(ent_C)
    if not logprob_chunks:  # empty input
        empty_T = hidden_TH.new_zeros((0,), dtype=torch.promote_types(hidden_TH.dtype, torch.float32))
        return empty_T, (empty_T if with_entropy else None)
    logprobs_T = torch.cat(logprob_chunks)
    return logprobs_T, (torch.cat(entropy_chunks) if with_entropy else None)
