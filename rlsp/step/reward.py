"""The reward subsystem: one interface over every way rlsp computes rewards, chosen once from the layout.

    rules           rule/custom reward functions (rlsp.rewards) in `reward_model.num_workers` scoring
                    actors, or with 0 in the policy workers, that read the rows by reference
                    (rlsp/controller/reward_workers.py), plus the
                    dapo manager's overlong shaping (rlsp/rewards/overlong.py)
    model_fsdp      a frozen reward model on the policy workers, FSDP2 (rlsp/workers/roles/reward_model.py)
    model_vllm      the reward loop: a vLLM pooling engine on the policy workers, rendering each row
                    with the reward model's chat template (rlsp/workers/roles/reward_loop.py)
    model_servers   the same engines in processes of their own beside the policy workers, where the
                    rollout engine runs at another tensor-parallel degree (rlsp/controller/reward_servers.py)

With a reward model its score is the training reward (verl's rule) and the rule functions score
validation only. Tool step rewards of agent loops are added to the token-level scores whichever
computes the outcome reward. The trainer calls `score` (training rows), `score_validation` and
`metrics`; it never branches on the mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from rlsp.config.layout import ParallelLayout
from rlsp.controller.reward_servers import RewardServers
from rlsp.controller.reward_workers import ScoringPool, start_scoring_processes
from rlsp.controller.worker_group import RayWorkerGroup
from rlsp.data.batch import response_lengths
from rlsp.rewards.overlong import OverlongShaping, build_overlong_shaping, compute_overlong_penalty
from rlsp.rewards.scoring import apply_rm_scores, manager_extra_info
from rlsp.rewards.token_scores import shaped_token_scores

ModelScores = Callable[[Any], Any]  # rows -> their `rm_scores` columns (a StepData of the same rows)


class Reward:
    """The run's rewards (see the module docstring); `model` is None for rule rewards. Scoring a step's rows
    reads none of their worker-held columns: the scorers read the rows by reference and report each row's score."""

    def __init__(self, cfg: DictConfig, rules: ScoringPool, model: ModelScores | None = None,
                 servers: RewardServers | None = None) -> None:
        self.rules, self.model, self.servers = rules, model, servers
        self.shaping = build_overlong_shaping(cfg) if model is None else None  # the dapo manager's overlong shaping
        self.step_rewards = bool(cfg.actor_rollout_ref.rollout.multi_turn.use_step_rewards)
        self.last_errors = 0  # reward functions that failed on the last rows scored (reward.on_error=zero)

    def score(self, rows: Any) -> np.ndarray:
        """Per-row scores of training rows; sets their token-level scores (and what estimators read of them)."""
        if self.model is None:
            scores = self.rules.score_rows(rows)
            self.last_errors = self.rules.last_errors
            if self.shaping is not None and hasattr(rows, "derive"):  # a step: the penalty per row (below)
                rows.set("overlong_reward", overlong_penalties(self.shaping, rows))
            elif self.shaping is not None:
                self.shaping.apply(rows)  # scores stay the reward function's values (accuracy, filter metrics)
        else:
            rows.update(self.model(rows))
            self.last_errors = 0
            # A step's rows (StepData) get the reward model's per-row reports (rm_score, rm_row_reward: every path
            # declares them, rlsp.workers.roles.reward_model), so no [rows x response] column is read; a Batch
            # holds its rm_scores already (apply_rm_scores)
            scores = apply_rm_scores(rows)
        # Tool step rewards at the end of the turn that earned them (rlsp/workers/agent_rollout.py).
        step = self.step_rewards and "step_rewards" in rows
        if hasattr(rows, "derive") and (step or "overlong_reward" in rows):
            derive_shaped_scores(rows, step)
        elif step:
            rows.set("token_level_scores", rows["token_level_scores"] + rows["step_rewards"] * rows["response_mask"])
        return scores

    def score_validation(self, rows: Any) -> np.ndarray:
        """Validation rows: the rule/custom reward functions (also with a reward model, as verl scores them)."""
        return self.rules.score_rows(rows)

    def metrics(self, rows: Any) -> dict[str, float]:
        shaped = self.shaping.metrics(rows) if self.shaping is not None else {}
        return {"reward/errors": float(self.last_errors), **shaped}

    def shutdown(self) -> None:
        if self.servers is not None:
            self.servers.shutdown()


def overlong_penalties(shaping: OverlongShaping, rows: Any) -> torch.Tensor:
    """[B] float64 overlong penalties of a step's rows, from the lengths the rollout reported per row."""
    lengths_B = rows["response_length"] if "response_length" in rows else torch.tensor(response_lengths(rows))
    return compute_overlong_penalty(lengths_B, shaping.max_resp_len, shaping.buffer_len, shaping.penalty_factor)


def derive_shaped_scores(rows: Any, step_rewards: bool) -> None:
    """A step's `token_level_scores` with the overlong penalty and/or step rewards, built on the driver only if
    it reads them: the workers' step stage builds them from the same per-row parts (rlsp.rewards.token_scores),
    so no [rows x response] scores cross the driver otherwise."""
    def build(d: Any) -> torch.Tensor:
        rm = d["rm_scores"] if "rm_scores" in d else None
        return shaped_token_scores(d["response_mask"], None if rm is not None else d["row_reward"], rm,
                                   d["overlong_reward"] if "overlong_reward" in d else None,
                                   d["step_rewards"] if step_rewards else None)

    rows.derive("token_level_scores", build)


def start_rule_scorers(cfg: DictConfig) -> list[Any]:
    """The rule-scoring processes (they score validation too), started now: they load while the training
    workers do; none with reward_model.num_workers=0 (the policy workers score)."""
    r = cfg.reward
    return start_scoring_processes(cfg.reward_model.num_workers, cfg.actor_rollout_ref.model.path,
                                   r.custom_function_path, r.custom_function_name, r.on_error,
                                   manager_extra_info(r.reward_manager.name, cfg.trainer.experiment_name))


def build_reward(cfg: DictConfig, layout: ParallelLayout, scorers: list[Any], wg: RayWorkerGroup,
                 servers: RewardServers | None) -> Reward:
    """The reward subsystem of this layout (`layout.reward_mode`): the rule scorers always (`scorers`, or
    the policy workers when there are none), and where a reward model runs."""
    rules = ScoringPool(scorers) if scorers else ScoringPool(list(wg.workers), wg.rank_name)
    if layout.reward_mode == "rules":
        return Reward(cfg, rules)
    if layout.reward_mode == "model_servers":
        if servers is None:
            raise RuntimeError("reward_mode 'model_servers' without reward servers: they start with the training workers")
        return Reward(cfg, rules, servers.compute_rm_score, servers)
    # model_fsdp / model_vllm: the reward_model role on the policy workers (an FSDP model, or the reward loop's engine)
    return Reward(cfg, rules, lambda rows: wg.call("reward_model", "compute_rm_score", rows))
