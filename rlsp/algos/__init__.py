"""Pure tensor math for RL: advantage estimators, policy losses, KL estimators, loss aggregation.

Importing this package imports every estimator and loss module, so the registries are full.
No torch.distributed here: global counts are passed in by the caller.
"""

from rlsp.algos import (  # noqa: F401  (registration)
    aliases,
    bypass,
    cispo,
    clip_cov,
    dppo,
    gae,
    gdpo,
    geo_mean,
    gpg,
    gpg_loss,
    grpo,
    grpo_passk,
    gspo,
    kl_cov,
    opo,
    otb,
    policy_loss,
    reinforce_pp,
    remax,
    rloo,
    rollout_is,
    rollout_rs,
    sapo,
)
from rlsp.algos.aggregation import (
    aggregate_loss,
    aggregate_token_mean,
    masked_mean,
    masked_sum,
    masked_whiten,
)
from rlsp.algos.kl import compute_kl
from rlsp.algos.policy_loss import compute_ppo_clip_loss
from rlsp.algos.registry import (
    get_adv_estimator,
    get_policy_loss,
    list_adv_estimators,
    list_policy_losses,
    register_adv_estimator,
    register_policy_loss,
)

__all__ = [
    "aggregate_loss",
    "aggregate_token_mean",
    "compute_kl",
    "compute_ppo_clip_loss",
    "get_adv_estimator",
    "get_policy_loss",
    "list_adv_estimators",
    "list_policy_losses",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "register_adv_estimator",
    "register_policy_loss",
]
