"""GPG policy loss: plain policy gradient, no ratio and no clipping (registered as "gpg").

"GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning" (arXiv:2504.02546),
whose objective drops PPO's surrogate for the REINFORCE form

    loss = -A * logp,         d loss / d logp = -A

verl's "gpg" policy loss, paired with its "gpg" advantage estimator (rlsp/algos/gpg.py). The old
logprobs are not read, so nothing corrects for an update that is off-policy (several mini-batches or
epochs): the loss is the on-policy gradient estimator. None of the clip keywords apply; each must
stay at its default (start-up validation refuses them; the actor passes this loss no keyword). Like verl,
it reports no clip or KL metric (only "num_tokens").

Shape legend: "..." any shape shared by all inputs ([B, R] padded or [T] packed).
"""

from __future__ import annotations

import torch

from rlsp.algos.cispo import token_metrics
from rlsp.algos.loss_context import LossContext
from rlsp.algos.registry import register_policy_loss


@register_policy_loss("gpg")
def compute_gpg_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    context: LossContext | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG per-token loss -A * logp: (loss_tokens, metrics).

    loss_tokens has the inputs' shape with exact zeros where ``mask`` is off; ``old_logprobs`` is
    accepted for the shared signature and ignored, and so is ``context``. metrics: {"num_tokens"} only (verl
    reports none).
    """
    loss = -advantages * logprobs
    loss_tokens = torch.where(mask.bool(), loss, torch.zeros_like(loss))
    return loss_tokens, token_metrics({}, mask, loss.dtype)
