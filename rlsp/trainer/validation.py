"""Validation: the validation set's samples from the rollout engines, scored by the rule/custom reward
functions (also with a reward model, as verl scores them); `val/*` metrics and the generation log."""

from __future__ import annotations

from functools import partial
from typing import Any

from rlsp.controller.reads import read_columns
from rlsp.controller.worker_group import RayWorkerGroup
from rlsp.data.dataset import PromptDataset
from rlsp.step.batch_metrics import compute_agent_metrics
from rlsp.step.reward import Reward
from rlsp.trainer.rollout_inputs import prompt_batch, sampling_params
from rlsp.trainer.val_generations import ValGenerationLog


def run_validation(cfg: Any, rollout_wg: RayWorkerGroup, reward: Reward, val_set: PromptDataset,
                   val_log: ValGenerationLog | None) -> dict[str, float]:
    """Generate every validation prompt's samples on `rollout_wg` (padded to its world size), score them with
    `reward`, write the first ones to `val_log`; returns the val/* metrics."""
    items = [val_set[i] for i in range(len(val_set))]
    padded = items + items[: (-len(items)) % rollout_wg.world_size]
    sampling = sampling_params(cfg, 0, validate=True)
    batch = rollout_wg.call("rollout", "generate", prompt_batch(padded), sampling)
    batch = batch.select_rows(slice(0, len(items) * sampling["n"]))  # each prompt's samples are contiguous
    scores = reward.score_validation(batch)
    read = partial(read_columns, rollout_wg)  # the engines' workers build what the driver reads
    if val_log is not None:
        val_log.write(read(batch, val_log.reads), scores)
    agent = {f"val/{k}": v for k, v in compute_agent_metrics(batch, read).items()}
    return {"val/accuracy": float((scores >= 1.0).mean()), "val/reward_mean": float(scores.mean()),
            "val/num_prompts": float(len(items)), "val/num_samples": float(len(scores)), **agent}
