"""What the loop's driver-side computations read of a step's worker-held columns.

A step's columns stay on the workers that computed them (rlsp.controller.step_data); the driver holds the
per-row values they report. Where the loop computes on the driver with token-level columns (the greedy
baseline's prompts, estimators without a per-row form, distillation), it first names those columns in one
`read` call (rlsp.controller.reads.read_columns): the lists below say which, beside the functions that
read them.
"""

from __future__ import annotations

from typing import Any

from rlsp.algos.registry import estimator_uses
from rlsp.controller.reads import Read
from rlsp.controller.step_data import StepData
from rlsp.trainer.baselines import PROMPT_META
from rlsp.trainer.estimator_inputs import BATCH_INPUTS
from rlsp.trainer.off_policy import correction_reads, rollout_correction_settings

# rlsp.trainer.baselines.add_greedy_baselines: the samples' prompts (prompts_of) and the mask's dtype.
GREEDY_READS = ("input_ids", "attention_mask", "response_mask", *PROMPT_META)
# rlsp.trainer.distill.Distillation.apply, besides the teacher logprobs it asks for (see ReadResults).
DISTILL_READS = ("response_mask", "old_logprobs", "advantages")


def advantage_reads(cfg: Any) -> list[str]:
    """What rlsp.trainer.estimator_inputs.advantage_inputs reads for the configured estimator."""
    uses = estimator_uses(cfg.algorithm.adv_estimator)
    names = ["token_level_rewards", "response_mask", "uid"]
    names += [key for field, (key, _) in BATCH_INPUTS.items() if field in uses]
    if "reward_components" in uses:
        names += ["reward_extra_info", "data_source"]
    if "rollout_is_weights_BR" in uses:
        names += correction_reads(rollout_correction_settings(cfg))
    return names


class ReadResults:
    """A worker group whose row results come back with their columns read to the driver: for a driver-side
    computation that asks the workers for columns and then reads all of them (distillation's teacher
    logprobs)."""

    def __init__(self, wg: Any, read: Read) -> None:
        self.wg, self.read = wg, read

    def call(self, role: str, method: str, *args: Any) -> Any:
        result = self.wg.call(role, method, *args)
        return self.read(result, sorted(result.keys())) if isinstance(result, StepData) else result
