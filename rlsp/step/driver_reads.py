"""What the loop's driver-side computations read of a step's worker-held columns.

A step's columns stay on the workers that computed them (rlsp.controller.step_data); the driver holds the
per-row values they report. Where the loop computes on the driver with token-level columns (the greedy
baseline's prompts), it first names those columns in one `read` call (rlsp.controller.reads.read_columns):
the lists below say which, beside the functions that read them. Every token-level estimator runs on the
policy workers (rlsp.step.stage_advantages), so the advantages read nothing here.
"""

from __future__ import annotations

from rlsp.step.baselines import PROMPT_META

# rlsp.step.baselines.add_greedy_baselines: the samples' prompts (prompts_of) and the mask's dtype.
GREEDY_READS = ("input_ids", "attention_mask", "response_mask", *PROMPT_META)
