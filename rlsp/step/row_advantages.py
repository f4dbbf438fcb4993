"""Outcome advantages from per-row values: the driver's part of a step without the rows' tokens.

An outcome estimator (GRPO, RLOO, ...) reads each row's summed token reward, the row's group and a
few per-row inputs, and gives every response token of a row the same advantage. For those the driver
runs the very same registered estimator on a *compact* record: the response axis shrunk to one
position holding the row's summed reward, with mask 1 (0 for a row without response tokens). The
result, one value per row, is kept as a row broadcast (rlsp.controller.step_data) that becomes
`value * response_mask` on the workers — the expression the estimators use — so the advantages equal
the token-level computation's bit for bit (tests/unit/test_row_advantages.py checks every estimator
listed here against it, on masks with holes and empty rows).

Anything that makes token rewards differ from "the row's reward on its last token" (a KL penalty in
the reward, tool step rewards, overlong shaping) or an estimator that reads per-token inputs (GAE,
REINFORCE++, the optimal token baselines) takes the token-level path: on the policy workers
(rlsp.step.stage_advantages), or on the driver for what the workers cannot compute.
"""

from __future__ import annotations

from typing import Any

import torch

from rlsp.algos.registry import compute_advantages
from rlsp.data.batch import Batch
from rlsp.step.estimator_inputs import advantage_inputs

# Estimators whose advantage is one value per row, broadcast over its response tokens.
ROW_LEVEL_ESTIMATORS = ("grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "grpo_passk", "gpg", "remax")


def row_level(cfg: Any, batch: Any) -> bool:
    """Whether this step's advantages can be computed from per-row values (see the module docstring)."""
    alg, rollout = cfg.algorithm, cfg.actor_rollout_ref.rollout
    return (alg.adv_estimator in ROW_LEVEL_ESTIMATORS and not alg.use_kl_in_reward
            and not rollout.multi_turn.use_step_rewards and "row_reward" in batch and "response_tokens" in batch
            and "overlong_reward" not in batch and "token_level_scores" not in getattr(batch, "table", batch))


def compact_rows(batch: Any) -> Batch:
    """The estimator's rows with a response axis of one position (see the module docstring)."""
    has_response = (batch["response_tokens"] > 0).to(torch.float32)
    rewards = (batch["row_reward"].to(torch.float32) * has_response).unsqueeze(-1)
    meta = {k: batch.meta[k] for k in ("uid", "data_source", "reward_extra_info") if k in batch.meta}
    tensors = {"token_level_rewards": rewards, "response_mask": has_response.unsqueeze(-1)}
    if "reward_baselines" in batch:
        tensors["reward_baselines"] = batch["reward_baselines"]
    return Batch.from_dict(tensors, meta=meta)


def compute_row_advantages(batch: Any, cfg: Any) -> None:
    """`advantages` and `returns` of every row, kept as row broadcasts on `batch` (a StepData)."""
    adv_B1, ret_B1 = compute_advantages(cfg.algorithm.adv_estimator, advantage_inputs(compact_rows(batch), cfg))
    batch.set_row("advantages", adv_B1[:, 0])
    batch.set_row("returns", ret_B1[:, 0])
