"""GMPO: geometric-mean policy optimisation (registered as "geo_mean", verl's name).

"Geometric-Mean Policy Optimization" (Zhao et al., arXiv:2507.20673), equation 4. GRPO maximises the
arithmetic mean of a response's token-level terms r_t A; GMPO maximises their geometric mean, which an
outlier token ratio moves far less. With token-level clipping in log space, by the sign of the advantage:

    x_t  = logp_t - old_logp_t
    c_t  = sgn(A_t) * min( sgn(A_t) x_t, sgn(A_t) clip(x_t, -eps_low, eps_high) )
    m_i  = (1/|y_i|) sum_t c_t,         A_i = (1/|y_i|) sum_t A_t   (a sequence-level advantage)
    L_i  = -A_i exp(m_i)                                                                   (to minimise)

(for A > 0 the log-ratio is capped at eps_high, for A < 0 floored at -eps_low: the PPO trust region,
in log space.) L_i depends on every token of the row, so rlsp writes it as a per-token surrogate whose
value is L_i at every token and whose row mean has L_i's gradient:

    loss_t = sg(L_i) * (1 + c_t - sg(c_t)),    d loss_t / d logp_t = L_i dc_t/dlogp_t,
    d/dlogp_t (1/|y_i|) sum_t' loss_t' = (L_i / |y_i|) dc_t/dlogp_t = dL_i/dlogp_t.

The aggregation mode then averages: seq-mean-token-mean gives the paper's (1/G) sum_i L_i, which verl
computes for geo_mean whatever `loss_agg_mode` says; rlsp follows the key (set
`loss_agg_mode=seq-mean-token-mean` for the paper's objective). m_i and A_i come from the loss context,
exact when a row is split over sequence-parallel shards.

As in verl: eps_low / eps_high are ``clip_ratio_low`` / ``clip_ratio_high`` read as log-space bounds (GMPO's
recommended 0.4 is a ratio range of [e^-0.4, e^0.4]); the log-ratio is not clamped otherwise; metrics are
"pg_clipfrac" (tokens with A > 0 whose x_t lies outside [-eps_low, eps_high]), "pg_clipfrac_lower" (the
same for A < 0) and "ppo_kl" (old_logp - logp, token mean).

Shape legend: "..." any shape shared by all inputs ([S] local tokens with a context, or [B, R] rows).
"""

from __future__ import annotations

import torch

from rlsp.algos.cispo import token_metrics
from rlsp.algos.loss_context import LossContext, context_or_rows
from rlsp.algos.registry import register_policy_loss


@register_policy_loss("geo_mean")
def compute_geo_mean_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    context: LossContext | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO per-token surrogate sg(L_i) * (1 + c_t - sg(c_t)), L_i = -A_i exp(mean_t c_t): (loss_tokens, metrics).

    ``context`` gives each token its row's means (None: the inputs are whole rows [..., R]). loss_tokens has
    the inputs' shape with exact zeros where ``mask`` is off.
    """
    if clip_ratio_low < 0.0 or clip_ratio_high < 0.0:
        raise ValueError(f"geo_mean reads clip_ratio_low / clip_ratio_high as log-ratio bounds, which must be >= 0; "
                         f"got {clip_ratio_low}, {clip_ratio_high}")
    rows = context_or_rows(context, mask)
    log_ratio = logprobs - old_logprobs
    sign = torch.sign(advantages)
    bounded = log_ratio.clamp(-clip_ratio_low, clip_ratio_high)
    clipped_log_ratio = sign * torch.minimum(sign * log_ratio, sign * bounded)
    seq_loss = -rows.row_mean(advantages) * torch.exp(rows.row_mean(clipped_log_ratio))  # L_i, detached
    loss = seq_loss * (1.0 + clipped_log_ratio - clipped_log_ratio.detach())
    loss_tokens = torch.where(mask.bool(), loss, torch.zeros_like(loss))
    outside = log_ratio != bounded
    indicators = {
        "pg_clipfrac": outside & (advantages > 0),
        "pg_clipfrac_lower": outside & (advantages < 0),
        "ppo_kl": -log_ratio,
    }
    return loss_tokens, token_metrics(indicators, mask, loss.dtype)
