"""The critic's training loss on one sequence shard: the clipped value loss aggregated as
`critic.loss_agg_mode` says over the whole mini-batch (per-token weights from global counts, see
rlsp.algos.aggregation), so summing losses/gradients over micro-batches and ranks is exact. The
clip fraction and mean prediction metrics are token-means whatever the mode."""

from __future__ import annotations

import torch

from rlsp.algos.aggregation import LossScale, compute_token_weights, loss_divisor, weighted_sum
from rlsp.algos.value_loss import compute_value_loss
from rlsp.engine.fsdp_engine import LossFn
from rlsp.engine.micro import MicroBatch


def make_critic_loss(cliprange_value: float, global_tokens: float, global_seqs: float | None = None,
                     loss_agg_mode: str = "token-mean") -> LossFn:
    """`global_seqs` is needed by the seq-mean-* modes; seq-mean-token-sum-norm divides by the response
    width (verl's value loss passes no loss_scale_factor)."""
    scale = LossScale(loss_agg_mode, global_tokens, global_seqs)

    def loss_fn(out: dict[str, torch.Tensor], micro: MicroBatch):
        values_S = out["values"]
        mask_S, old_S, returns_S = (micro.response_local(k).to(values_S.device)
                                    for k in ("response_mask", "values", "returns"))
        weights_S = micro.response_values_local(compute_token_weights(micro.rows["response_mask"], scale.mode))
        divisor = loss_divisor(scale, micro.response_len)
        loss_tokens, sums = compute_value_loss(values_S, old_S, returns_S, mask_S, cliprange_value)
        vf_loss = weighted_sum(loss_tokens, mask_S, weights_S.to(values_S.device), divisor)
        metrics = {"critic/vf_loss": vf_loss.detach(),
                   "critic/vf_clipfrac": sums["vf_clipfrac_sum"] / global_tokens,
                   "critic/vpred_mean": sums["vpred_sum"] / global_tokens}
        return vf_loss, metrics

    return loss_fn
