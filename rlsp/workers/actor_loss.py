"""The actor's training loss on one sequence shard: policy loss + KL to the reference - entropy bonus.

Every term is aggregated as `actor.loss_agg_mode` says (verl applies the same mode to all three), over
the whole mini-batch: the per-token weights come from the micro-batch's full rows and the mini-batch's
global counts (rlsp.algos.aggregation), so summing losses/gradients over micro-batches and ranks is
exact. The clip fractions, ppo_kl and logprob_diff metrics are token-means whatever the mode.

The policy loss gets exactly its own keys (``loss_kwargs``, from rlsp.config.validate_policy_loss) and a
loss context (rlsp.workers.loss_context) for the row and micro-batch statistics of sequence-level losses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from rlsp.algos.aggregation import LossScale, compute_token_weights, loss_divisor, weighted_sum
from rlsp.algos.kl import compute_kl
from rlsp.algos.registry import get_policy_loss
from rlsp.engine.fsdp_engine import LossFn
from rlsp.engine.micro import MicroBatch
from rlsp.workers.loss_context import MicroBatchContext

# Token-mean metrics a policy loss may report (as "<name>_sum"), and the names they are logged under (verl's).
LOSS_METRICS = {"pg_clipfrac": "actor/pg_clipfrac", "pg_clipfrac_lower": "actor/pg_clipfrac_lower",
                "ppo_kl": "actor/ppo_kl", "rollout_is_weight": "rollout_corr/rollout_is_mean"}


@dataclass(frozen=True)
class ActorLossConfig:
    policy_loss: str = "vanilla"
    loss_kwargs: Mapping[str, Any] = field(default_factory=dict)  # the loss's own keys; absent = its defaults
    use_kl_loss: bool = True
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm's divisor; None = the response width


def make_actor_loss(cfg: ActorLossConfig, global_tokens: float, global_seqs: float | None = None) -> LossFn:
    """The loss of one micro-batch; `global_tokens` / `global_seqs`: response tokens / sequences of the
    whole mini-batch (`global_seqs` is needed by the seq-mean-* modes)."""
    policy_loss = get_policy_loss(cfg.policy_loss)
    scale = LossScale(cfg.loss_agg_mode, global_tokens, global_seqs, cfg.loss_scale_factor)

    def loss_fn(out: dict[str, torch.Tensor], micro: MicroBatch):
        logprobs_S, entropy_S = out["logprobs"], out.get("entropy")
        mask_S = micro.response_local("response_mask").to(logprobs_S.device)
        weights_S = micro.response_values_local(compute_token_weights(micro.rows["response_mask"], scale.mode))
        divisor = loss_divisor(scale, micro.response_len)
        weights_S = weights_S.to(logprobs_S.device)
        if "old_logprobs" in micro.rows:
            old_S = micro.response_local("old_logprobs").to(logprobs_S.device)
        else:  # on-policy: the policy that sampled is the one being updated, so old = current, detached
            old_S = logprobs_S.detach()
        adv_S = micro.response_local("advantages").to(logprobs_S.device)
        context = MicroBatchContext(micro, logprobs_S.device)
        pg_tokens, pg_metrics = policy_loss(logprobs_S, old_S, adv_S, mask_S, context=context, **cfg.loss_kwargs)
        if "rollout_is_weights" in micro.rows:  # off-policy correction (algorithm.rollout_correction.rollout_is)
            pg_tokens = pg_tokens * micro.response_local("rollout_is_weights").to(logprobs_S.device)
        pg_loss = weighted_sum(pg_tokens, mask_S, weights_S, divisor)
        loss = pg_loss
        metrics = {"actor/pg_loss": pg_loss.detach()}
        if "old_logprobs" not in micro.rows:  # the separate pass that would report it was skipped
            diff_S = (micro.response_local("rollout_logprobs").to(logprobs_S.device) - old_S).abs() * mask_S
            metrics["rollout/logprob_diff"] = diff_S.sum() / global_tokens
            metrics["rollout/logprob_diff_max"] = diff_S.max() if diff_S.numel() else diff_S.new_zeros(())
        for name, key in LOSS_METRICS.items():  # those the loss reports (gpg: none)
            if f"{name}_sum" in pg_metrics:
                metrics[key] = pg_metrics[f"{name}_sum"] / global_tokens
        if cfg.use_kl_loss:
            ref_S = micro.response_local("ref_logprobs").to(logprobs_S.device)
            kl_loss = weighted_sum(compute_kl(logprobs_S, ref_S, cfg.kl_loss_type), mask_S, weights_S, divisor)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss.detach()
        if entropy_S is not None:
            entropy = weighted_sum(entropy_S, mask_S, weights_S, divisor)
            if cfg.entropy_coeff != 0.0:
                loss = loss - cfg.entropy_coeff * entropy
            metrics["actor/entropy"] = entropy.detach()
        return loss, metrics

    return loss_fn
