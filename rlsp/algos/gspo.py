"""GSPO: group sequence policy optimisation, a sequence-level importance ratio (registered as "gspo").

"Group Sequence Policy Optimization" (Zheng et al., arXiv:2507.18071), equations 5-7 and the token form
GSPO-token (section 4.3). The ratio is that of whole responses, length-normalised:

    s_i     = (pi(y_i | x) / pi_old(y_i | x)) ^ (1 / |y_i|) = exp( (1/|y_i|) sum_t (logp_t - old_logp_t) )
    J(i)    = min( s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i )                      (to maximise)

GSPO-token writes it per token with s_i,t = sg(s_i) * pi_t / sg(pi_t): its value is s_i at every token and
d s_i,t / d logp_t = s_i, so the mean over a row's tokens of min(s_i,t A_i,t, clip(s_i,t) A_i,t) has J(i)'s
value and gradient (with A_i,t = A_i). rlsp returns that per-token loss,

    loss_t  = max( -A_t s_i,t, -A_t clip(s_i,t, 1 - eps_low, 1 + eps_high) ),

and the aggregation mode turns it into a scalar: seq-mean-token-mean gives the paper's (1/G) sum_i -J(i)
(verl applies that mode to gspo whatever `loss_agg_mode` says; rlsp follows the key, so set
`loss_agg_mode=seq-mean-token-mean` for the paper's objective). The row mean of the log-ratio comes from
the loss context, exact when a row is split over sequence-parallel shards.

As in verl: eps_low / eps_high are ``clip_ratio_low`` / ``clip_ratio_high`` (the paper and verl's example
use 3e-4 / 4e-4: a sequence ratio moves far less than a token's), log s_i,t is clamped at 10 (no gradient
above), and the metrics are "pg_clipfrac" (tokens where the clipped term is the larger loss),
"pg_clipfrac_lower" (always 0) and "ppo_kl" (old_logp - logp, token mean).

Shape legend: "..." any shape shared by all inputs ([S] local tokens with a context, or [B, R] rows).
"""

from __future__ import annotations

import torch

from rlsp.algos.cispo import token_metrics
from rlsp.algos.loss_context import LossContext, context_or_rows
from rlsp.algos.registry import register_policy_loss

# verl's bound on log s_i,t: exp() of more is meaningless for a length-normalised ratio.
MAX_SEQ_LOG_RATIO = 10.0


@register_policy_loss("gspo")
def compute_gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    context: LossContext | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token per-token loss max(-A s_i,t, -A clip(s_i,t)): (loss_tokens, metrics).

    ``context`` gives each token its row's mean log-ratio (None: the inputs are whole rows [..., R]).
    loss_tokens has the inputs' shape with exact zeros where ``mask`` is off.
    """
    if not 0.0 <= clip_ratio_low < 1.0 or clip_ratio_high < 0.0:
        raise ValueError(f"gspo needs 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, got {clip_ratio_low}, "
                         f"{clip_ratio_high}")
    log_ratio = logprobs - old_logprobs
    seq_log_ratio = context_or_rows(context, mask).row_mean(log_ratio)  # detached: sg(log s_i)
    log_s = (logprobs - logprobs.detach() + seq_log_ratio).clamp(max=MAX_SEQ_LOG_RATIO)
    s = torch.exp(log_s)
    loss_unclipped = -advantages * s
    loss_clipped = -advantages * s.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    loss_tokens = torch.where(mask.bool(), loss, torch.zeros_like(loss))
    indicators = {
        "pg_clipfrac": loss_clipped > loss_unclipped,
        "pg_clipfrac_lower": torch.zeros_like(loss),
        "ppo_kl": -log_ratio,
    }
    return loss_tokens, token_metrics(indicators, mask, loss.dtype)
