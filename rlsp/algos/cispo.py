"""CISPO: clipped importance-sampling-weight policy optimisation (registered as "cispo").

"MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention" (arXiv:2506.13585),
equations 4-5. Instead of clipping the surrogate (which zeroes the gradient of a clipped token, as
PPO does), CISPO clips the importance weight and stops its gradient, so every token keeps a
REINFORCE-style gradient scaled by a bounded weight:

    r       = exp(logp - old_logp)
    r_hat   = clip(r, 1 - eps_low, 1 + eps_high)
    J       = sg(r_hat) * A * logp                  (to maximise)
    loss    = -sg(r_hat) * A * logp,     d loss / d logp = -r_hat * A

As in verl, eps_low / eps_high are the PPO keys ``clip_ratio_low`` / ``clip_ratio_high`` (both
defaulting to ``clip_ratio`` = 0.2), and the log-ratio is clamped to [-20, 20] before ``exp``. The paper
puts no lower bound on the weight and tunes only eps_high: clip_ratio_low >= 1 drops the lower bound
(verl's CISPO example sets 10); verl and rlsp keep the symmetric 0.2 default. ``clip_ratio_c`` (the dual-clip bound) is not used by CISPO: the actor passes a
loss only the keys it reads (rlsp/config/validate_policy_loss.py), and start-up validation refuses the others
set off their defaults.

Shape legend: "..." any shape shared by all inputs ([B, R] padded or [T] packed).
"""

from __future__ import annotations

import torch

from rlsp.algos.aggregation import masked_sum
from rlsp.algos.loss_context import LossContext
from rlsp.algos.policy_loss import MAX_LOG_RATIO
from rlsp.algos.registry import register_policy_loss


def token_metrics(indicators: dict[str, torch.Tensor], mask: torch.Tensor, dtype: torch.dtype
                  ) -> dict[str, torch.Tensor]:
    """Per-token indicators -> local masked means "<name>", masked sums "<name>_sum" and "num_tokens",
    so a caller can all-reduce sums and counts and divide once for exact global metrics."""
    with torch.no_grad():
        num_tokens = mask.to(dtype).sum()
        metrics: dict[str, torch.Tensor] = {"num_tokens": num_tokens}
        for name, values in indicators.items():
            total = masked_sum(values.detach().to(dtype), mask)
            metrics[f"{name}_sum"] = total
            metrics[name] = total / num_tokens.clamp_min(1.0)
    return metrics


@register_policy_loss("cispo")
def compute_cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    context: LossContext | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO per-token loss -sg(clip(r, 1 - low, 1 + high)) * A * logp: (loss_tokens, metrics).

    loss_tokens has the inputs' shape with exact zeros where ``mask`` is off. metrics (verl's names):
    "pg_clipfrac" (tokens whose weight was clipped), "pg_clipfrac_lower" (always 0, as in verl),
    "ppo_kl" (old_logprobs - logprobs), each with "<name>_sum", plus "num_tokens". A token-level loss:
    ``context`` is accepted like every loss's and not read.
    """
    if clip_ratio_low < 0.0 or clip_ratio_high < 0.0:
        raise ValueError(f"cispo needs clip_ratio_low >= 0 and clip_ratio_high >= 0 (clip_ratio_low >= 1: no lower "
                         f"bound), got {clip_ratio_low}, {clip_ratio_high}")
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = -clipped.detach() * advantages * logprobs
    loss_tokens = torch.where(mask.bool(), loss, torch.zeros_like(loss))
    indicators = {
        "pg_clipfrac": ratio != clipped,
        "pg_clipfrac_lower": torch.zeros_like(ratio),
        "ppo_kl": -log_ratio,
    }
    return loss_tokens, token_metrics(indicators, mask, loss.dtype)
