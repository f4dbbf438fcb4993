"""Per-token policy-gradient losses, registered by name ("vanilla" = PPO clip with dual clip).

Every registered policy loss shares one signature::

    fn(logprobs, old_logprobs, advantages, mask, *, <the keys it reads>, context=None) -> (loss_tokens, metrics)

The actor passes exactly the keys rlsp/config/validate_policy_loss.py lists for the loss (POLICY_LOSS_KEYS)
and a loss context (rlsp/algos/loss_context.py) with row and micro-batch statistics for losses that need
them. Losses are returned per token (0 where masked out); turning them into a scalar is the job of
rlsp.algos.aggregation, so that the normalisation is the global one.

Shape legend: "..." any shape shared by all inputs ([B, R] padded or [T] packed).
"""

from __future__ import annotations

import torch

from rlsp.algos.aggregation import masked_sum
from rlsp.algos.loss_context import LossContext
from rlsp.algos.registry import register_policy_loss

# exp() of a log-ratio beyond this is either inf or meaningless; clamping keeps the loss finite.
MAX_LOG_RATIO = 20.0


def _check_clip_args(clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float) -> None:
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(f"clip_ratio_low must be in [0, 1), got {clip_ratio_low}")
    if clip_ratio_high < 0.0:
        raise ValueError(f"clip_ratio_high must be >= 0, got {clip_ratio_high}")
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound) must be > 1, got {clip_ratio_c}")


@register_policy_loss("vanilla")
def compute_ppo_clip_loss(
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
    """PPO clipped surrogate with dual clip: (loss_tokens, metrics).

    ratio = exp(clamp(logprobs - old_logprobs, -20, 20));
    clipped = max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high));
    loss = min(clipped, -A * clip_ratio_c) where A < 0 (dual clip), else clipped.
    loss_tokens has the inputs' shape with exact zeros where ``mask`` is off. A token-level loss: ``context``
    (row and micro-batch statistics, rlsp.algos.loss_context) is accepted like every loss's and not read.

    metrics (detached, over this call's tokens only):
      "pg_clipfrac"        fraction of tokens where the clip range bound the loss,
      "pg_clipfrac_lower"  fraction of tokens where the dual clip bound it (A < 0),
      "ppo_kl"             mean of old_logprobs - logprobs,
    each a local masked mean, plus the masked sums "<name>_sum" and the token count "num_tokens",
    so a caller can all-reduce sums and counts and divide once for exact global metrics.
    """
    _check_clip_args(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual = torch.minimum(loss_ppo, -advantages * clip_ratio_c)
    negative_adv = advantages < 0
    loss = torch.where(negative_adv, loss_dual, loss_ppo)
    loss_tokens = torch.where(mask.bool(), loss, torch.zeros_like(loss))

    with torch.no_grad():
        indicators = {
            "pg_clipfrac": (loss_clipped > loss_unclipped).to(loss.dtype),
            "pg_clipfrac_lower": (negative_adv & (loss_ppo > loss_dual)).to(loss.dtype),
            "ppo_kl": -log_ratio,
        }
        num_tokens = mask.to(loss.dtype).sum()
        metrics: dict[str, torch.Tensor] = {"num_tokens": num_tokens}
        for name, values in indicators.items():
            total = masked_sum(values.detach(), mask)
            metrics[f"{name}_sum"] = total
            metrics[name] = total / num_tokens.clamp_min(1.0)
    return loss_tokens, metrics
