"""Clip-Cov: PPO clip that also detaches a few high-covariance tokens (registered as "clip_cov").

"The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models" (Cui et al.,
arXiv:2505.22617), section 4: entropy collapses because tokens whose log-probability and advantage
co-vary strongly dominate the update; clipping the gradient of a small random share of them keeps
entropy up. Per micro-batch (rlsp/algos/cov_select.py), with r = exp(clip(logp - old_logp, -20, 20)):

    ppo_t       = max(-A r, -A clip(r, 1 - low, 1 + high))                 (PPO clip, no dual clip)
    clipped_t   = -A clip(r, ...) > -A r                                    (the clip range binds)
    cov_t       = (A_t - mean A) (logp_t - mean logp)
    candidates  = {t : mask_t, not clipped_t, clip_cov_lb < cov_t < clip_cov_ub}
    picked      = max(int(clip_cov_ratio * N), 1) candidates drawn at random (all if fewer), N = the
                  micro-batch's response tokens
    loss_t      = ppo_t * (0 if t in picked else 1)

A picked token's loss (and gradient) is zeroed, as verl does. Keys and defaults are verl's:
clip_ratio_low / clip_ratio_high (default clip_ratio = 0.2), clip_cov_ratio = 0.0002, clip_cov_lb =
1.0, clip_cov_ub = 5.0; clip_ratio_c (the dual clip) is not used. The log-ratio is clamped to +-20
before exp, as in rlsp's other losses (verl's clip_cov does not clamp; the two differ only beyond it).

Sequence parallelism: the means are micro-batch sums over every shard and the draw is made on the
gathered scores in canonical order from a seed every shard shares, so a sharded micro-batch picks
exactly the tokens one rank holding it would (the loss context; see cov_select.py). As in verl the statistics
and the pick count are per micro-batch: the micro-batch size changes them.

Metrics (verl's): "pg_clipfrac" (share of tokens picked, not those the clip range binds), "ppo_kl".

Shape legend: "..." any shape shared by all inputs ([B, R] padded or [T] packed).
"""

from __future__ import annotations

import torch

from rlsp.algos.cispo import token_metrics
from rlsp.algos.cov_select import covariance_N, pick_clip_cov, pick_count, selection_seed
from rlsp.algos.loss_context import LossContext, context_or_rows
from rlsp.algos.policy_loss import MAX_LOG_RATIO
from rlsp.algos.registry import register_policy_loss

CLIP_COV_RATIO, CLIP_COV_LB, CLIP_COV_UB = 0.0002, 1.0, 5.0


def check_clip_cov_args(clip_cov_ratio: float, clip_cov_lb: float, clip_cov_ub: float) -> None:
    if not 0.0 < clip_cov_ratio <= 1.0:
        raise ValueError(f"clip_cov_ratio (share of tokens to detach) must be in (0, 1], got {clip_cov_ratio}")
    if not clip_cov_lb < clip_cov_ub:
        raise ValueError(f"clip_cov_lb must be < clip_cov_ub (the covariance window), got {clip_cov_lb}, {clip_cov_ub}")


@register_policy_loss("clip_cov")
def compute_clip_cov_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_cov_ratio: float = CLIP_COV_RATIO,
    clip_cov_lb: float = CLIP_COV_LB,
    clip_cov_ub: float = CLIP_COV_UB,
    context: LossContext | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov per-token loss (see the module docstring): (loss_tokens, metrics). ``context``: the
    micro-batch's statistics across shards (None: the inputs are whole rows [..., R])."""
    check_clip_cov_args(clip_cov_ratio, clip_cov_lb, clip_cov_ub)
    if not 0.0 <= clip_ratio_low < 1.0 or clip_ratio_high < 0.0:
        raise ValueError(f"clip_cov needs 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, "
                         f"got {clip_ratio_low}, {clip_ratio_high}")
    context = context_or_rows(context, mask)
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    on = mask.bool()
    with torch.no_grad():  # the pick, on the micro-batch's gathered tokens (the same on every shard)
        adv_N, on_N = context.to_batch(advantages), context.to_batch(on.to(advantages.dtype))
        cov_N = covariance_N(adv_N, context.to_batch(logprobs), on_N)
        binds_N = context.to_batch((loss_clipped > loss_unclipped).to(cov_N.dtype)).bool()
        candidate_N = on_N.bool() & ~binds_N & (cov_N > clip_cov_lb) & (cov_N < clip_cov_ub)
        count = pick_count(int(on_N.sum()), clip_cov_ratio)
        picks_N = pick_clip_cov(cov_N, candidate_N, count, selection_seed(adv_N, on_N))
        picked = context.from_batch(picks_N.to(cov_N.dtype)).bool().to(on.device)
    loss = torch.where(picked, torch.zeros_like(loss_clipped), torch.maximum(loss_unclipped, loss_clipped))
    loss_tokens = torch.where(on, loss, torch.zeros_like(loss))
    return loss_tokens, token_metrics({"pg_clipfrac": picked, "ppo_kl": -log_ratio}, mask, loss.dtype)
