"""What the loop's driver-side computations read of a step's worker-held columns.

A step's columns stay on the workers that computed them (rlsp.controller.step_data); the driver holds the
per-row values they report. Where the loop computes on the driver with token-level columns (the greedy
baseline's prompts, estimators the workers cannot compute), it first names those columns in one
`read` call (rlsp.controller.reads.read_columns): the lists below say which, beside the functions that
read them.
"""

from __future__ import annotations

from typing import Any

from rlsp.algos.adv_columns import input_columns
from rlsp.algos.registry import estimator_uses
from rlsp.step.baselines import PROMPT_META
from rlsp.step.off_policy import reads_is_weights

# rlsp.step.baselines.add_greedy_baselines: the samples' prompts (prompts_of) and the mask's dtype.
GREEDY_READS = ("input_ids", "attention_mask", "response_mask", *PROMPT_META)


def advantage_reads(cfg: Any) -> list[str]:
    """What rlsp.step.estimator_inputs.advantage_inputs reads for the configured estimator."""
    name = cfg.algorithm.adv_estimator
    names = ["token_level_rewards", "response_mask", "uid", *input_columns(name, reads_is_weights(cfg)).values()]
    if "reward_components" in estimator_uses(name):
        names += ["reward_extra_info", "data_source"]
    return names

