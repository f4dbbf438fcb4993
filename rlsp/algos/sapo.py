"""SAPO: soft adaptive policy optimisation, a soft gate instead of the hard clip (registered as "sapo").

"Soft Adaptive Policy Optimization" (Gao et al., arXiv:2511.20347). Each token's importance ratio goes
through a temperature-controlled sigmoid gate whose gradient fades smoothly as the ratio leaves 1,
instead of PPO's clip that cuts it to zero at a fixed band:

    r_t        = exp(logp_t - old_logp_t)
    tau_t      = tau_pos if A_t > 0 else tau_neg
    f(r; tau)  = sigmoid(tau (r - 1)) * 4 / tau
    loss_t     = -f(r_t; tau_t) * A_t

    d loss_t / d logp_t = -A_t * r_t * 4 sigmoid(.) (1 - sigmoid(.))

so at r = 1 the gradient is the plain policy gradient -A_t (4 * 1/2 * 1/2 = 1) and it decays as r moves
away, faster for a larger tau. The paper sets tau_neg > tau_pos (negative updates spread to many
unsampled tokens and destabilise sooner) and uses tau_pos = 1.0, tau_neg = 1.05: verl's defaults,
`actor_rollout_ref.actor.policy_loss.tau_pos` / `tau_neg` in rlsp (verl declares them on the actor;
rlsp rewrites that spelling onto these keys).

A token-level loss: ``context`` is accepted and not read. verl aggregates sapo with seq-mean-token-mean
whatever `loss_agg_mode` says; rlsp follows the key (the paper's objective: seq-mean-token-mean). As in
verl the log-ratio is clamped to [-20, 20] before exp, and the metrics are "pg_clipfrac" and
"pg_clipfrac_lower" (always 0: nothing is clipped) and "ppo_kl" (old_logp - logp of the clamped ratio).

Shape legend: "..." any shape shared by all inputs ([B, R] padded or [T] packed).
"""

from __future__ import annotations

import torch

from rlsp.algos.cispo import token_metrics
from rlsp.algos.loss_context import LossContext
from rlsp.algos.policy_loss import MAX_LOG_RATIO
from rlsp.algos.registry import register_policy_loss


@register_policy_loss("sapo")
def compute_sapo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    context: LossContext | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO per-token loss -sigmoid(tau (r - 1)) * 4 / tau * A: (loss_tokens, metrics).

    loss_tokens has the inputs' shape with exact zeros where ``mask`` is off.
    """
    if not (tau_pos > 0.0 and tau_neg > 0.0):
        raise ValueError(f"sapo's gate temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = -gate * advantages
    loss_tokens = torch.where(mask.bool(), loss, torch.zeros_like(loss))
    indicators = {
        "pg_clipfrac": torch.zeros_like(loss),
        "pg_clipfrac_lower": torch.zeros_like(loss),
        "ppo_kl": -log_ratio,
    }
    return loss_tokens, token_metrics(indicators, mask, loss.dtype)
