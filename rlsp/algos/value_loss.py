"""Clipped value loss of the PPO critic (per token; aggregation is the caller's, see aggregation.py).

    v_clip = clamp(v, v_old - c, v_old + c)
    loss_t = 0.5 * max((v - G)^2, (v_clip - G)^2)

with v the new value, v_old the value at rollout time, G the return and c ``cliprange_value``.

Shape legend: "..." any shape shared by all inputs ([B, R] padded or [S] packed shard).
"""

from __future__ import annotations

import torch

from rlsp.algos.aggregation import masked_sum


def compute_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss_tokens, metrics): per-token clipped value loss (exact 0 where ``mask`` is off).

    metrics (detached sums over this call's masked-in tokens, for exact global means):
    "vf_clipfrac_sum" tokens whose value was clipped AND whose clipped term was the larger one (an
    unclipped token's `old + (v - old)` differs from v by rounding only, which must not count),
    "vpred_sum" sum of values.
    """
    if cliprange_value <= 0:
        raise ValueError(f"cliprange_value must be > 0, got {cliprange_value}")
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    loss_unclipped = (values - returns).square()
    loss_clipped = (clipped - returns).square()
    loss = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
    loss_tokens = torch.where(mask.bool(), loss, torch.zeros_like(loss))
    with torch.no_grad():
        metrics = {
            "vf_clipfrac_sum": masked_sum(((values - old_values).abs() > cliprange_value)
                                          .logical_and(loss_clipped > loss_unclipped).to(loss.dtype), mask),
            "vpred_sum": masked_sum(values.detach(), mask),
        }
    return loss_tokens, metrics


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(G - v) / Var(G) over masked-in tokens (1 = perfect, 0 = no better than a constant)."""
    keep = mask.bool()
    g, v = returns[keep].double(), values[keep].double()
    if g.numel() < 2:
        return float("nan")
    var_g = g.var(unbiased=False)
    return float(1.0 - (g - v).var(unbiased=False) / var_g) if var_g > 0 else float("nan")
