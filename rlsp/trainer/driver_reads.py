"""What the loop's driver-side computations read of a step's worker-held columns.

A step's columns stay on the workers that computed them (rlsp.controller.step_data); the driver holds the
per-row values they report. Where the loop computes on the driver with token-level columns (the greedy
baseline's prompts, estimators the workers cannot compute), it first names those columns in one
`read` call (rlsp.controller.reads.read_columns): the lists below say which, beside the functions that
read them.
"""

from __future__ import annotations

from typing import Any

from rlsp.algos.registry import estimator_uses
from rlsp.trainer.baselines import PROMPT_META
from rlsp.trainer.estimator_inputs import BATCH_INPUTS
from rlsp.trainer.off_policy import reads_is_weights

# rlsp.trainer.baselines.add_greedy_baselines: the samples' prompts (prompts_of) and the mask's dtype.
GREEDY_READS = ("input_ids", "attention_mask", "response_mask", *PROMPT_META)


def advantage_reads(cfg: Any) -> list[str]:
    """What rlsp.trainer.estimator_inputs.advantage_inputs reads for the configured estimator."""
    uses = estimator_uses(cfg.algorithm.adv_estimator)
    names = ["token_level_rewards", "response_mask", "uid"]
    names += [key for field, (key, _) in BATCH_INPUTS.items() if field in uses]
    if "reward_components" in uses:
        names += ["reward_extra_info", "data_source"]
    if reads_is_weights(cfg):  # the correction's weights, computed on the workers before the advantages
        names += ["rollout_is_weights"]
    return names

