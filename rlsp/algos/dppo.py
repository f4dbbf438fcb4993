"""DPPO: divergence proximal policy optimisation, Binary-TV and Binary-KL (registered as "dppo_tv", "dppo_kl").

"Rethinking the Trust Region in LLM Reinforcement Learning" (Qi et al., arXiv:2602.04879). PPO's
ratio clip is a one-sample estimate of the policy divergence: it over-penalises rare tokens (a
probability going 1e-5 -> 1e-3 is a ratio of 100) and under-penalises likely ones (0.99 -> 0.8 is
a ratio of 0.81). DPPO masks a token out of the update when a direct estimate of the divergence
between the old and the current policy, restricted to the sampled token's binary distribution
{y_t, not y_t}, leaves the trust region in the direction the advantage pushes:

    p = exp(logp), p_old = exp(old_logp), r = exp(clip(logp - old_logp, -20, 20))
    Binary-TV:  D = p - p_old                                  (signed total variation)
        keep(A > 0)  = D <=  delta_high,     keep(A <= 0) = D >= -delta_low
    Binary-KL:  D = p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p))
        keep(A > 0)  = D <= delta_high or p <= p_old,   keep(A <= 0) = D <= delta_low or p >= p_old
    loss = -A * sg(min(r, C)) * logp * keep,      d loss / d logp = -A * min(r, C) * keep

The surrogate's gradient is the importance-weighted policy gradient, with the weight truncated at C
(truncated IS replaces the dual clip; the paper recommends a large C, its section 5.4). Following
verl, the thresholds delta_low / delta_high are the PPO keys ``clip_ratio_low`` / ``clip_ratio_high``
(read as divergence bounds: verl's DPPO example uses 0.15 for TV and 0.05 for KL) and C is
``clip_ratio_c`` (default 3.0, as verl's actor config; verl's example sets 10000 to disable it).
Binary-KL adds 1e-8 inside its second logarithm, as verl does, so p -> 1 stays finite. Every factor
of the weight is detached, so only logp carries the gradient; an A == 0 token takes the negative
branch (its loss is 0 either way).

Metrics (verl's names): "pg_clipfrac" (tokens masked out of the trust region), "pg_clipfrac_lower"
(kept tokens whose weight was truncated at C), "ppo_kl" (old_logp - logp).

Shape legend: "..." any shape shared by all inputs ([B, R] padded or [T] packed).
"""

from __future__ import annotations

import torch

from rlsp.algos.cispo import token_metrics
from rlsp.algos.loss_context import LossContext
from rlsp.algos.policy_loss import MAX_LOG_RATIO
from rlsp.algos.registry import register_policy_loss

BINARY_KL_EPS = 1e-8


def _check(loss: str, clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float) -> None:
    if clip_ratio_low < 0.0 or clip_ratio_high < 0.0:
        raise ValueError(f"{loss} reads clip_ratio_low / clip_ratio_high as divergence thresholds, which must be "
                         f">= 0; got {clip_ratio_low}, {clip_ratio_high}")
    if not clip_ratio_c > 0.0:
        raise ValueError(f"{loss} truncates the importance weight at clip_ratio_c, which must be > 0; got {clip_ratio_c}")


def binary_tv(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """Signed binary total variation p - p_old of the sampled token."""
    return torch.exp(logprobs) - torch.exp(old_logprobs)


def binary_kl(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(old || current) of the binary distributions {sampled token, any other token}."""
    p, p_old = torch.exp(logprobs), torch.exp(old_logprobs)
    rest = torch.log((1.0 - p_old + BINARY_KL_EPS) / (1.0 - p + BINARY_KL_EPS))
    return p_old * (old_logprobs - logprobs) + (1.0 - p_old) * rest


def _dppo_loss(keep: torch.Tensor, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
               mask: torch.Tensor, clip_ratio_c: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-A * sg(min(r, C)) * logp * keep, zeros where masked out, and the metrics."""
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    weight = (ratio.clamp(max=clip_ratio_c) * keep).detach()
    loss = -advantages * weight * logprobs
    loss_tokens = torch.where(mask.bool(), loss, torch.zeros_like(loss))
    indicators = {
        "pg_clipfrac": ~keep,
        "pg_clipfrac_lower": keep & (ratio > clip_ratio_c),
        "ppo_kl": -log_ratio,
    }
    return loss_tokens, token_metrics(indicators, mask, loss.dtype)


@register_policy_loss("dppo_tv")
def compute_dppo_tv_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    context: LossContext | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-TV per-token loss (see the module docstring): (loss_tokens, metrics). A token-level
    loss: ``context`` is accepted like every loss's and not read."""
    _check("dppo_tv", clip_ratio_low, clip_ratio_high, clip_ratio_c)
    with torch.no_grad():
        tv = binary_tv(logprobs, old_logprobs)
        keep = torch.where(advantages > 0, tv <= clip_ratio_high, tv >= -clip_ratio_low)
    return _dppo_loss(keep, logprobs, old_logprobs, advantages, mask, clip_ratio_c)


@register_policy_loss("dppo_kl")
def compute_dppo_kl_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    context: LossContext | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-KL per-token loss (see the module docstring): (loss_tokens, metrics). A token-level
    loss: ``context`` is accepted like every loss's and not read."""
    _check("dppo_kl", clip_ratio_low, clip_ratio_high, clip_ratio_c)
    with torch.no_grad():
        kl = binary_kl(logprobs, old_logprobs)
        p, p_old = torch.exp(logprobs), torch.exp(old_logprobs)
        # A move against the advantage's push never leaves the region: only the divergence it wants is bounded.
        keep = torch.where(advantages > 0, (kl <= clip_ratio_high) | (p <= p_old), (kl <= clip_ratio_low) | (p >= p_old))
    return _dppo_loss(keep, logprobs, old_logprobs, advantages, mask, clip_ratio_c)
