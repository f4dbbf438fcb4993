"""Token rewards and token-level advantages computed on the policy workers: the driver's side.

Where a step's rewards and advantages are computed:

- outcome estimators (GRPO, RLOO, ...) without anything that changes the token rewards: on the driver,
  from per-row values (rlsp.trainer.row_advantages);
- `gae` and `reinforce_plus_plus`, with or without KL in the reward: on the workers, in one call
  (`ActorRole.compute_advantages`, rlsp.workers.step_stage); the driver sends the request and receives
  each row's KL and the row sums of its metrics;
- any other estimator with KL in the reward: the KL penalty on the workers, the estimator on the driver
  (it reads the token rewards);
- the rest (group estimators with step rewards or overlong shaping, the optimal token baselines,
  distillation, rollout correction): on the driver, reading the columns they need.

The adaptive KL controller stays on the driver: it is updated with the mean over rows of each row's
token-mean KL, the workers' per-row values (the same number as the one-process computation).
"""

from __future__ import annotations

from typing import Any

from rlsp.algos.kl_ctrl import KLController, batch_kl
from rlsp.algos.registry import compute_advantages
from rlsp.data.batch import Batch
from rlsp.trainer.estimator_inputs import advantage_inputs, config_settings
from rlsp.workers.step_stage import STAGE_ESTIMATORS, StageRequest


def advantages_on_workers(cfg: Any) -> bool:
    """Whether the step's advantages are computed by the workers (see the module docstring)."""
    return cfg.algorithm.adv_estimator in STAGE_ESTIMATORS


def compute_token_rewards(wg: Any, batch: Any, cfg: Any, kl_ctrl: KLController) -> dict[str, float]:
    """`token_level_rewards` (and, for the estimators of `advantages_on_workers`, `advantages` and `returns`)
    of `batch`, a step whose rows are held by `wg`'s workers; the KL metrics with use_kl_in_reward."""
    alg = cfg.algorithm
    on_workers = advantages_on_workers(cfg)
    if not on_workers and not alg.use_kl_in_reward:
        batch.set("token_level_rewards", batch["token_level_scores"])
        return {}
    beta = kl_ctrl.value if alg.use_kl_in_reward else None
    request = StageRequest(alg.adv_estimator if on_workers else None, config_settings(cfg) if on_workers else {},
                           beta, alg.kl_penalty)
    batch.update(wg.call("actor", "compute_advantages", batch, request))
    if beta is None:
        return {}
    current_kl = batch_kl(batch["reward_kl"])
    kl_ctrl.update(current_kl, n_steps=len(batch))
    return {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


def compute_driver_advantages(batch: Batch, cfg: Any) -> None:
    """`advantages` and `returns` of an estimator that runs on the driver, from the token-level columns."""
    adv, ret = compute_advantages(cfg.algorithm.adv_estimator, advantage_inputs(batch, cfg))
    batch.set("advantages", adv)
    batch.set("returns", ret)


def _reported(batch: Any, keys: tuple[str, ...]) -> bool:
    """Whether the workers reported `keys` for the advantages they hold (the driver has not replaced them since,
    as distillation does)."""
    table = getattr(batch, "table", None)
    return table is not None and all(k in table for k in keys) and "advantages" not in table.tensors.keys()


def reported_critic_metrics(batch: Any) -> dict[str, float] | None:
    """The critic metrics of rlsp.trainer.batch_metrics from the workers' per-row sums (None without them)."""
    needed = ("response_tokens", "score_sum", "reward_sum", "advantages_sum", "returns_sum", "values_sum",
              "returns_sq_sum", "residual_sum", "residual_sq_sum")
    if not _reported(batch, needed):
        return None
    n = batch["response_tokens"].double().sum().clamp_min(1.0)
    mean = {k: batch[k].double().sum() / n for k in needed[3:]}
    var_g = mean["returns_sq_sum"] - mean["returns_sum"] ** 2
    var_r = mean["residual_sq_sum"] - mean["residual_sum"] ** 2
    explained = float(1.0 - var_r / var_g) if n >= 2 and var_g > 0 else float("nan")
    return {"critic/score/mean": float(batch["score_sum"].mean()), "critic/rewards/mean": float(batch["reward_sum"].mean()),
            "critic/advantages/mean": float(mean["advantages_sum"]), "critic/returns/mean": float(mean["returns_sum"]),
            "critic/values/mean": float(mean["values_sum"]), "critic/vf_explained_var": explained}


def reported_advantage_mean(batch: Any) -> float | None:
    """Mean advantage over response tokens from the workers' per-row sums (None without them)."""
    if not _reported(batch, ("advantages_sum", "response_tokens")):
        return None
    tokens = batch["response_tokens"].double().sum().clamp_min(1.0)
    return float(batch["advantages_sum"].double().sum() / tokens)

