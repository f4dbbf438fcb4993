"""KL-Cov: the unclipped surrogate plus a KL penalty on the highest-covariance tokens (registered as "kl_cov").

"The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models" (Cui et al.,
arXiv:2505.22617), section 4: instead of clipping, penalise the tokens whose log-probability and
advantage co-vary most with |log r|, which keeps them near the old policy. Per micro-batch
(rlsp/algos/cov_select.py), with log r = logp - old_logp:

    cov_t     = (A_t - mean A) (logp_t - mean logp)                  (means over the response tokens)
    top       = the max(int(kl_cov_ratio * N), 1) tokens of largest cov_t, N = the micro-batch's tokens
    loss_t    = -A_t r_t + (ppo_kl_coef * |log r_t| if t in top else 0)

There is no ratio clip. Keys and defaults are verl's: kl_cov_ratio = 0.0002, ppo_kl_coef = 0.1 (under
actor.policy_loss); none of the clip keys apply. As in verl the log-ratio is not clamped (r may
overflow only where the policy moved by more than e^88, which the penalty exists to prevent); ties in
cov go to the earlier token in canonical order.

Sequence parallelism: the means are micro-batch sums over every shard and the top-k is taken on the
gathered scores, so a sharded micro-batch penalises exactly the tokens one rank holding it would
(the loss context). As in verl the statistics and k are per micro-batch: the micro-batch size changes them.

Metrics (verl's): "ppo_kl" is the mean of |log r| (an absolute value, unlike the other losses'); no
clip fraction.

Shape legend: "..." any shape shared by all inputs ([B, R] padded or [T] packed).
"""

from __future__ import annotations

import torch

from rlsp.algos.cispo import token_metrics
from rlsp.algos.cov_select import covariance_N, pick_count, pick_top_cov
from rlsp.algos.loss_context import LossContext, context_or_rows
from rlsp.algos.registry import register_policy_loss

KL_COV_RATIO, PPO_KL_COEF = 0.0002, 0.1


def check_kl_cov_args(kl_cov_ratio: float, ppo_kl_coef: float) -> None:
    if not 0.0 < kl_cov_ratio <= 1.0:
        raise ValueError(f"kl_cov_ratio (share of tokens to penalise) must be in (0, 1], got {kl_cov_ratio}")
    if ppo_kl_coef < 0.0:
        raise ValueError(f"ppo_kl_coef (the KL penalty's weight) must be >= 0, got {ppo_kl_coef}")


@register_policy_loss("kl_cov")
def compute_kl_cov_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_cov_ratio: float = KL_COV_RATIO,
    ppo_kl_coef: float = PPO_KL_COEF,
    context: LossContext | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov per-token loss (see the module docstring): (loss_tokens, metrics). ``context``: the
    micro-batch's statistics across shards (None: the inputs are whole rows [..., R])."""
    check_kl_cov_args(kl_cov_ratio, ppo_kl_coef)
    context = context_or_rows(context, mask)
    log_ratio = logprobs - old_logprobs
    abs_kl = log_ratio.abs()
    on = mask.bool()
    with torch.no_grad():  # the top-k, on the micro-batch's gathered tokens (the same on every shard)
        on_N = context.to_batch(on.to(logprobs.dtype))
        cov_N = covariance_N(context.to_batch(advantages), context.to_batch(logprobs), on_N)
        top_N = pick_top_cov(cov_N, on_N, pick_count(int(on_N.sum()), kl_cov_ratio))
        top = context.from_batch(top_N.to(cov_N.dtype)).bool().to(on.device)
    loss = -advantages * torch.exp(log_ratio) + torch.where(top, ppo_kl_coef * abs_kl, torch.zeros_like(abs_kl))
    loss_tokens = torch.where(on, loss, torch.zeros_like(loss))
    return loss_tokens, token_metrics({"ppo_kl": abs_kl}, mask, loss.dtype)
