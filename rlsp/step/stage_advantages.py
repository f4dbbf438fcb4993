"""Token rewards and token-level advantages computed on the policy workers: the driver's side.

Where a step's rewards and advantages are computed:

- outcome estimators (GRPO, RLOO, ...) without anything that changes the token rewards: on the driver,
  from per-row values (rlsp.step.row_advantages);
- every other estimator, with or without KL in the reward: on the workers, in one call
  (`ActorRole.compute_advantages`, rlsp.workers.step_stage); the driver sends the request and receives
  each row's KL and the row sums of its metrics. An estimator that reads groups gets shards cut on group
  boundaries (`stage_shards`: the step's rows reordered for this call only, no data moves): equal ones when the
  groups allow (`group_aligned_order`), else shards of unequal row counts, whole groups balanced by rows
  (`group_shards`; a dp group may get no rows when there are fewer groups than dp groups);
- the token scores themselves: the driver keeps their per-row parts (each row's reward, dapo's overlong
  penalty `overlong_reward`) and the agent loop's step rewards stay a worker column; the workers build the
  [rows x response] scores from them (rlsp.rewards.token_scores), the driver only if it reads them;
- gdpo's reward is the named components of the reward function's per-row dicts, held here: the driver sends
  them with the call, one float per row and component (rlsp.step.estimator_inputs.set_stage_components);
- the optimal token baselines with rollout-correction importance weights: on the workers, reading the weights
  the correction wrote before the advantages (rlsp.step.off_policy.correct_rollout, once a step);
- trainer.balance_batch keeps groups whole on one dp rank when the workers need them and an equal cut allows
  it (`balanced_step_order`), so the stage's shards are then the step's own;
- after the advantages, on the workers: distillation's term (rlsp.step.distill, rlsp.workers.stage_distill).

The adaptive KL controller stays on the driver: it is updated with the mean over rows of each row's
token-mean KL, the workers' per-row values (the same number as the one-process computation).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omegaconf import OmegaConf

from rlsp.algos.kl_ctrl import KLController, batch_kl
from rlsp.algos.registry import reads_groups
from rlsp.data.balance import balanced_order
from rlsp.step.estimator_inputs import config_settings, set_stage_components
from rlsp.step.off_policy import reads_is_weights
from rlsp.step.row_advantages import ROW_LEVEL_ESTIMATORS
from rlsp.workers.step_stage import StageRequest


def _rows_by_group(uids: Sequence[Any]) -> dict[Any, list[int]]:
    """uid -> the rows of that prompt group, in order."""
    groups: dict[Any, list[int]] = {}
    for row, uid in enumerate(uids):
        groups.setdefault(uid, []).append(row)
    return groups


def group_aligned_order(uids: Sequence[Any], parts: int) -> list[int] | None:
    """A permutation of the rows after which `parts` equal contiguous chunks each hold whole groups (rows
    sharing a uid, kept in their order); None when the group sizes allow no such cut (first fit, largest
    group first: with equal groups, exactly when a chunk's size is a multiple of the group size)."""
    n = len(uids)
    if parts < 1 or n % parts:
        return None
    groups = _rows_by_group(uids)
    bins: list[list[list[int]]] = [[] for _ in range(parts)]
    room = [n // parts] * parts
    for rows in sorted(groups.values(), key=lambda r: (-len(r), r[0])):
        part = next((p for p in range(parts) if room[p] >= len(rows)), None)
        if part is None:
            return None
        bins[part].append(rows)
        room[part] -= len(rows)
    return [row for chunk in bins for rows in sorted(chunk) for row in rows]


def group_shards(uids: Sequence[Any], parts: int) -> tuple[list[int], list[int]]:
    """Whole groups in `parts` contiguous shards of near-equal row counts, for when no equal cut holds whole
    groups: (a permutation of the rows, each shard's row count). Greedy: largest group first (first row on ties),
    into the shard with the fewest rows so far (the first on ties), which with equal groups is the most even cut;
    a shard gets no rows when there are fewer groups than shards. A shard's rows keep the step's order."""
    if parts < 1:
        raise ValueError(f"parts={parts}: need at least one shard")
    members: list[list[int]] = [[] for _ in range(parts)]
    for rows in sorted(_rows_by_group(uids).values(), key=lambda r: (-len(r), r[0])):
        min(members, key=len).extend(rows)
    return [row for rows in members for row in sorted(rows)], [len(rows) for rows in members]


def whole_groups(uids: Sequence[Any], parts: int) -> bool:
    """Whether `parts` equal contiguous chunks of the rows (in this order) each hold whole groups."""
    n = len(uids)
    if parts < 1 or n % parts:
        return False
    chunk_of: dict[Any, int] = {}
    return all(chunk_of.setdefault(uid, row * parts // n) == row * parts // n for row, uid in enumerate(uids))


def balanced_group_order(tokens: Sequence[int], uids: Sequence[Any], parts: int) -> list[int] | None:
    """rlsp.data.balance.balanced_order with a group's rows as one unit: `parts` equal contiguous chunks with
    near-equal token sums, each holding whole groups (greedy: heaviest group first, into the lightest chunk
    that still has room); None when that greedy finds no exact fill."""
    n = len(uids)
    if parts < 1 or n % parts:
        return None
    groups = _rows_by_group(uids)
    members: list[list[int]] = [[] for _ in range(parts)]
    loads, room = [0] * parts, [n // parts] * parts
    for rows in sorted(groups.values(), key=lambda r: (-sum(tokens[i] for i in r), r[0])):
        fits = [p for p in range(parts) if room[p] >= len(rows)]
        if not fits:
            return None
        part = min(fits, key=lambda q: (loads[q], q))
        members[part] += rows
        loads[part] += sum(tokens[i] for i in rows)
        room[part] -= len(rows)
    return [i for m in members for i in sorted(m)]


def needs_group_shards(cfg: Any) -> bool:
    """Whether the step's estimator reads groups and runs on the workers (the outcome estimators that the
    driver computes from per-row values, rlsp.step.row_advantages, do not need group shards)."""
    alg, name = cfg.algorithm, cfg.algorithm.adv_estimator
    if not reads_groups(name):
        return False
    shaped = bool(OmegaConf.select(cfg, "reward.reward_kwargs.overlong_buffer_cfg.enable", default=False))
    return (name not in ROW_LEVEL_ESTIMATORS or bool(alg.use_kl_in_reward) or shaped
            or bool(cfg.actor_rollout_ref.rollout.multi_turn.use_step_rewards))


def balanced_step_order(cfg: Any, tokens: Sequence[int], uids: Sequence[Any], parts: int) -> list[int]:
    """trainer.balance_batch's row order: near-equal token sums over the dp ranks, every group whole in one
    rank's rows when the workers compute a group estimator (so its shards need no reordering)."""
    if needs_group_shards(cfg):
        order = balanced_group_order(tokens, uids, parts) or group_aligned_order(uids, parts)
        if order is not None:
            return order
    return balanced_order(list(tokens), parts)


def _dp_size(wg: Any) -> int:
    return wg.world_size // wg.layout.role("actor").ranks_per_dp


def stage_shards(batch: Any, cfg: Any, dp: int) -> tuple[list[int], list[int] | None]:
    """The row order in which the workers compute this step's advantages and each dp group's row count in it
    (None: equal chunks). The step's order when the estimator reads no groups or its equal chunks hold whole
    groups; else group-aligned equal chunks (`group_aligned_order`) when some exist, else `group_shards`."""
    uids = list(batch.meta["uid"]) if reads_groups(cfg.algorithm.adv_estimator) else []
    if not uids or whole_groups(uids, dp):
        return list(range(len(batch))), None
    order = group_aligned_order(uids, dp)
    return (order, None) if order is not None else group_shards(uids, dp)


def compute_token_rewards(wg: Any, batch: Any, cfg: Any, kl_ctrl: KLController) -> dict[str, float]:
    """`token_level_rewards`, `advantages` and `returns` of `batch`, a step whose rows are held by `wg`'s
    workers, computed by them (`ActorRole.compute_advantages`); the KL metrics with use_kl_in_reward."""
    alg = cfg.algorithm
    order, shards = stage_shards(batch, cfg, _dp_size(wg))
    beta = kl_ctrl.value if alg.use_kl_in_reward else None
    step = bool(cfg.actor_rollout_ref.rollout.multi_turn.use_step_rewards) and "step_rewards" in batch
    components = set_stage_components(batch, cfg)  # gdpo's: one float per row and key
    request = StageRequest(alg.adv_estimator, config_settings(cfg), beta, alg.kl_penalty, step, components,
                           rollout_is_weights=reads_is_weights(cfg))  # the correction's column
    if order == list(range(len(batch))):
        batch.update(wg.call("actor", "compute_advantages", batch, request, shards=shards))
    else:  # the call's rows in shards of whole groups, its columns put back in the step's order
        back = sorted(range(len(order)), key=order.__getitem__)
        rows = wg.call("actor", "compute_advantages", batch.select_rows(order), request, shards=shards)
        batch.update(rows.select_rows(back))
    if beta is None:
        return {}
    current_kl = batch_kl(batch["reward_kl"])
    kl_ctrl.update(current_kl, n_steps=len(batch))
    return {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


def _reported(batch: Any, keys: tuple[str, ...]) -> bool:
    """Whether the workers reported `keys` for the advantages they hold (the driver has not replaced them since;
    distillation's term, added on the workers, reports the new advantages' row sums)."""
    table = getattr(batch, "table", None)
    return table is not None and all(k in table for k in keys) and "advantages" not in table.tensors.keys()


def reported_critic_metrics(batch: Any) -> dict[str, float] | None:
    """The critic metrics of rlsp.step.batch_metrics from the workers' per-row sums (None without them)."""
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

