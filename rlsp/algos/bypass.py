"""Rollout-correction bypass mode: the rollout engine's logprobs are the old policy (registered as "bypass_mode").

verl's `algorithm.rollout_correction.bypass_mode=true` keeps two policies instead of three: the trainer
does not recompute old logprobs, the loss's old_logprobs are the engine's (pi_rollout), and the policy
loss is replaced by this one, chosen by `algorithm.rollout_correction.loss_type`:

    ppo_clip (default)   rlsp's "vanilla" PPO clip (dual clip included) with r = pi_theta / pi_rollout:
                         the ratio already is the importance weight, so no weight multiplies it; with
                         `rollout_is` set its weights are reported ("rollout_is_weight"), not applied
                         (verl's meaning: metrics only), and `rollout_rs` rejects tokens as with reinforce
    reinforce            loss_t = -A_t * w_t * logp_t,  d loss / d logp_t = -A_t * w_t, with w the
                         truncated importance weight pi_theta / pi_rollout (detached) of
                         `rollout_is` (token | sequence), or w = 1 with rollout_is=null (plain REINFORCE)

Unlike the decoupled correction (rlsp/step/off_policy.py, computed once a step on the policy workers from
the recomputed old logprobs), the weights and the rejection mask here come from the *current* logprobs,
per micro-batch, inside the update (as verl computes them in its bypass loss): `rollout_is`,
`rollout_is_threshold`, `rollout_is_batch_normalize` (the mean over the micro-batch's tokens or rows)
and `rollout_rs` / `rollout_rs_threshold` (a rejected token's loss is zeroed; it stays in the loss's
normalisation, as in verl, whose token counts are taken before the loss rejects) mean what
rlsp/algos/rollout_correction.py says. Row-level quantities (sequence weights, seq_* rejection,
the batch mean) see the whole micro-batch: the loss context gathers the logprobs of every shard, so
a sequence-parallel micro-batch is corrected exactly as one rank holding it would be.

Metrics: those of the PPO clip (ppo_clip), or "ppo_kl" = mean(rollout logp - logp) (reinforce, verl's); with
`rollout_is` set also "rollout_is_weight" (the truncated weights' token mean; the actor logs it as
rollout_corr/rollout_is_mean).

Shape legend: "..." a loss's token shape; N response tokens of the micro-batch (the loss context's
order); B' its rows that have response tokens, L the longest of them.
"""

from __future__ import annotations

import torch

from rlsp.algos.cispo import token_metrics
from rlsp.algos.loss_context import LossContext, context_or_rows
from rlsp.algos.policy_loss import compute_ppo_clip_loss
from rlsp.algos.registry import register_policy_loss
from rlsp.algos.rollout_correction import BYPASS_LOSS_TYPES, RolloutCorrection, compute_rollout_correction


def rows_of_batch(values_N: torch.Tensor, row_ids_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] values in row-major order -> (values [B', L], mask [B', L]): the rows that have tokens, each
    packed to the left (per-row and per-token statistics do not depend on positions)."""
    _, row_N, counts = torch.unique_consecutive(row_ids_N, return_inverse=True, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    pos_N = torch.arange(len(row_ids_N), device=row_ids_N.device) - starts[row_N]
    shape = (len(counts), int(counts.max()) if len(counts) else 0)
    values = torch.zeros(shape, dtype=values_N.dtype, device=values_N.device)
    mask = torch.zeros(shape, dtype=torch.bool, device=values_N.device)
    values[row_N, pos_N], mask[row_N, pos_N] = values_N, True
    return values, mask


def micro_batch_correction(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                           settings: RolloutCorrection, context: LossContext | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [...] or ones, keep mask [...]) of pi_theta / pi_rollout over the whole micro-batch."""
    on = mask.bool()
    if not settings.enabled:  # plain REINFORCE / PPO clip: nothing to gather
        return torch.ones_like(logprobs), on
    context = context_or_rows(context, mask)
    if context.batch_tokens() == 0:  # an idle micro-batch (padding only)
        return torch.ones_like(logprobs), on
    current_BL, keep_BL = rows_of_batch(context.to_batch(logprobs), context.row_ids)
    rollout_BL, _ = rows_of_batch(context.to_batch(rollout_logprobs), context.row_ids)
    weights_BL, kept_BL, _ = compute_rollout_correction(current_BL, rollout_BL, keep_BL.to(current_BL.dtype), settings)
    weights_BL = torch.ones_like(current_BL) if weights_BL is None else weights_BL
    weights = context.from_batch(weights_BL[keep_BL]).to(logprobs.device)
    kept = context.from_batch(kept_BL.to(current_BL.dtype)[keep_BL]).to(logprobs.device).bool()
    return weights.detach(), on & kept


@register_policy_loss("bypass_mode")
def compute_bypass_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "ppo_clip",
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    context: LossContext | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bypass-mode per-token loss (see the module docstring); ``old_logprobs`` are the rollout engine's."""
    if loss_type not in BYPASS_LOSS_TYPES:
        raise ValueError(f"algorithm.rollout_correction.loss_type={loss_type!r} is not supported; legal values: "
                         f"{list(BYPASS_LOSS_TYPES)}")
    settings = RolloutCorrection(rollout_is, float(rollout_is_threshold), bool(rollout_is_batch_normalize), rollout_rs,
                                 rollout_rs_threshold)
    with torch.no_grad():
        weights, keep = micro_batch_correction(logprobs.detach(), old_logprobs, mask, settings, context)
    keep = keep.to(mask.dtype)
    if loss_type == "ppo_clip":
        loss_tokens, metrics = compute_ppo_clip_loss(logprobs, old_logprobs, advantages, keep, clip_ratio_low=clip_ratio_low,
                                                     clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c)
    else:
        loss = -advantages * weights * logprobs
        loss_tokens = torch.where(keep.bool(), loss, torch.zeros_like(loss))
        metrics = token_metrics({"ppo_kl": old_logprobs - logprobs}, keep, loss.dtype)
    if rollout_is is not None:  # reported either way; only reinforce multiplies the loss by them
        metrics.update(token_metrics({"rollout_is_weight": weights}, keep, loss_tokens.dtype))
    return loss_tokens, metrics
