"""The critic's training loss on one sequence shard: the clipped value loss as a share of the global
token-mean over the mini-batch (divided by the global number of response tokens), so summing
losses/gradients over micro-batches and ranks is exact."""

from __future__ import annotations

import torch

from rlsp.algos.aggregation import aggregate_token_mean
from rlsp.algos.value_loss import compute_value_loss
from rlsp.engine.fsdp_engine import LossFn
from rlsp.engine.micro import MicroBatch


def make_critic_loss(cliprange_value: float, global_tokens: float) -> LossFn:
    def loss_fn(out: dict[str, torch.Tensor], micro: MicroBatch):
        values_S = out["values"]
        mask_S, old_S, returns_S = (micro.response_local(k).to(values_S.device)
                                    for k in ("response_mask", "values", "returns"))
        loss_tokens, sums = compute_value_loss(values_S, old_S, returns_S, mask_S, cliprange_value)
        vf_loss = aggregate_token_mean(loss_tokens, mask_S, global_tokens)
        metrics = {"critic/vf_loss": vf_loss.detach(),
                   "critic/vf_clipfrac": sums["vf_clipfrac_sum"] / global_tokens,
                   "critic/vpred_mean": sums["vpred_sum"] / global_tokens}
        return vf_loss, metrics

    return loss_fn
