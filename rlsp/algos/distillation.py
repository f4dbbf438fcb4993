"""On-policy distillation: the per-token divergence between the student (the policy that sampled) and a
frozen teacher on the student's own tokens, turned into a per-token advantage.

Following the on-policy distillation write-ups (Agarwal et al., GKD, arXiv:2306.13649; Thinking Machines,
"On-Policy Distillation", 2025) and verl's `distillation.distillation_loss.*` with use_policy_gradient=true:

    s_t = max(log pi_student(y_t | x, y_<t), m),   q_t = max(log pi_teacher(y_t | x, y_<t), m)
    d_t = clamp(D(s_t, q_t), -c, c)                 D: the KL estimator of `loss_mode` (rlsp.algos.kl):
                                                    k1: s - q (the sampled reverse KL), k2: (s - q)^2 / 2,
                                                    k3: exp(q - s) - (q - s) - 1, abs: |s - q|
    A_t = A_task_t - coef * d_t    (use_task_rewards=true: the estimator's advantage of the task reward)
    A_t = -d_t                      (use_task_rewards=false: distillation alone; coef is not applied)

with m = log_prob_min_clamp and c = loss_max_clamp (None: no floor / no clamp). d is computed from
detached log-probabilities: it is a reward, never differentiated. verl adds a second clipped policy loss
with advantage -d next to the task loss; rlsp adds -coef * d to the advantage of the one clipped loss:
the same objective and gradient while no token's ratio leaves the clip range (always so for on-policy
single updates, where ratio = 1); once ratios are clipped, the two can clip different tokens.

Everything here is per token or per row: the term runs on the policy workers' shards of the step's rows
(rlsp.workers.stage_distill), and the metrics (token means, extremes) are built from per-row statistics
that the driver puts together (`distillation_row_stats`, `distillation_metrics_from_rows`).

Shape legend: B rows, R response positions; every [B, R] tensor is zero where the response mask is.
"""

from __future__ import annotations

import torch

from rlsp.algos.kl import compute_kl


def compute_distillation_losses(student_logprobs_BR: torch.Tensor, teacher_logprobs_BR: torch.Tensor,
                                response_mask_BR: torch.Tensor, *, loss_mode: str = "k1",
                                loss_max_clamp: float | None = None,
                                log_prob_min_clamp: float | None = None) -> torch.Tensor:
    """d_t of the module docstring, [B, R], detached, zero off the response mask."""
    if student_logprobs_BR.shape != teacher_logprobs_BR.shape or student_logprobs_BR.shape != response_mask_BR.shape:
        raise ValueError(f"shapes differ: student {tuple(student_logprobs_BR.shape)}, teacher "
                         f"{tuple(teacher_logprobs_BR.shape)}, mask {tuple(response_mask_BR.shape)}")
    s_BR, q_BR = student_logprobs_BR.detach(), teacher_logprobs_BR.detach()
    if log_prob_min_clamp is not None:  # a token one model all but rules out would dominate every estimator
        s_BR, q_BR = s_BR.clamp_min(log_prob_min_clamp), q_BR.clamp_min(log_prob_min_clamp)
    d_BR = compute_kl(s_BR, q_BR, loss_mode)
    if loss_max_clamp is not None:  # both sides: k1 is negative where the teacher likes a token more
        d_BR = d_BR.clamp(-loss_max_clamp, loss_max_clamp)
    return torch.where(response_mask_BR.bool(), d_BR, torch.zeros_like(d_BR))


def compute_distillation_advantages(task_advantages_BR: torch.Tensor | None, distill_losses_BR: torch.Tensor,
                                    response_mask_BR: torch.Tensor, *, use_task_rewards: bool = True,
                                    coef: float = 1.0) -> torch.Tensor:
    """A_t of the module docstring, [B, R]: the task advantage minus coef * d (or -d alone)."""
    keep_BR = response_mask_BR.bool()
    if not use_task_rewards:
        return torch.where(keep_BR, -distill_losses_BR, torch.zeros_like(distill_losses_BR))
    if task_advantages_BR is None:
        raise ValueError("use_task_rewards=true needs the task advantages")
    adv_BR = task_advantages_BR - coef * distill_losses_BR
    return torch.where(keep_BR, adv_BR, torch.zeros_like(adv_BR))


# The per-row statistics the distillation metrics are built from (`distillation_row_stats`): sums over the row's
# response tokens (fp64), the row's extremes of d (+inf / -inf without a response token) and its token count.
ROW_STATS = ("distill_reverse_kl_sum", "distill_loss_sum", "distill_abs_loss_sum", "teacher_logprob_sum",
             "distill_loss_min", "distill_loss_max", "distill_tokens")


def distillation_row_stats(student_logprobs_BR: torch.Tensor, teacher_logprobs_BR: torch.Tensor,
                           distill_losses_BR: torch.Tensor, response_mask_BR: torch.Tensor) -> dict[str, torch.Tensor]:
    """`ROW_STATS` of each row, [B] each: a row's values depend on that row alone, so a shard of the rows gives
    the whole batch's values for its rows and `distillation_metrics_from_rows` of the rows put together equals
    `distillation_metrics` of the whole batch."""
    on_BR = response_mask_BR.bool()
    d_BR = distill_losses_BR.detach().double()

    def row_sum(x_BR: torch.Tensor) -> torch.Tensor:
        return torch.where(on_BR, x_BR.detach().double(), torch.zeros_like(d_BR)).sum(-1)

    inf = torch.full_like(d_BR, float("inf"))
    return {
        "distill_reverse_kl_sum": row_sum(student_logprobs_BR.double() - teacher_logprobs_BR.double()),
        "distill_loss_sum": row_sum(d_BR), "distill_abs_loss_sum": row_sum(d_BR.abs()),
        "teacher_logprob_sum": row_sum(teacher_logprobs_BR),
        "distill_loss_min": torch.where(on_BR, d_BR, inf).amin(-1),
        "distill_loss_max": torch.where(on_BR, d_BR, -inf).amax(-1),
        "distill_tokens": on_BR.sum(-1).double(),
    }


def distillation_metrics_from_rows(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """Token means over the rows of `stats` (`distillation_row_stats`, rows concatenated): the sampled reverse
    KL (student - teacher, unclamped), the clamped divergence d and its |d|, its min/max, and the teacher's
    mean logprob; {} without a response token."""
    tokens = float(stats["distill_tokens"].sum())
    if tokens == 0:
        return {}
    mean = lambda key: float(stats[key].sum() / tokens)  # noqa: E731
    return {
        "distillation/reverse_kl": mean("distill_reverse_kl_sum"),
        "distillation/loss": mean("distill_loss_sum"),
        "distillation/abs_loss": mean("distill_abs_loss_sum"),
        "distillation/loss_min": float(stats["distill_loss_min"].min()),
        "distillation/loss_max": float(stats["distill_loss_max"].max()),
        "distillation/teacher_logprob_mean": mean("teacher_logprob_sum"),
    }


def distillation_metrics(student_logprobs_BR: torch.Tensor, teacher_logprobs_BR: torch.Tensor,
                         distill_losses_BR: torch.Tensor, response_mask_BR: torch.Tensor) -> dict[str, float]:
    """The metrics of `distillation_metrics_from_rows` on one process's rows (the whole batch)."""
    return distillation_metrics_from_rows(distillation_row_stats(student_logprobs_BR, teacher_logprobs_BR,
                                                                 distill_losses_BR, response_mask_BR))
