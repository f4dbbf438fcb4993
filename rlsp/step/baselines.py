"""ReMax's greedy baseline: one greedy response per prompt, scored like the samples.

For `algorithm.adv_estimator=remax` (arXiv:2310.10505) each step generates, after the samples, one
greedy (temperature 0) response per prompt with the same engines and limits, scores it with the same
reward path as the samples (rule / custom function, or the reward model), and gives every sample of
that prompt its reward as `reward_baselines` (the estimator's `reward_baselines_B`). The extra pass is
timed as `timing/gen_baseline_s` (generation) and `timing/reward_baseline_s` (scoring); the baselines'
mean reward is logged as `reward/baseline_mean` (compare with the samples' `reward/mean`).

The pass reads nothing of the samples' worker-held columns: its prompts are the rows the step sent to the
engines (kept on the driver by the trainer, rlsp.trainer.rollout_inputs.StepPrompts; images included), picked by
the samples' uids, and the greedy rows' lengths are the rollout's per-row report (`response_tokens`).

What cannot work is refused at start-up (`baseline_errors`): generation ahead of training on a rollout
pool (the greedy pass would run with weights other than the samples').
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rlsp.algos.registry import estimator_uses
from rlsp.config.run_spec import rollout_pool_enabled
from rlsp.data.batch import Batch
from rlsp.rollout.base import SamplingConfig
from rlsp.utils.timing import timed

if TYPE_CHECKING:  # the trainer's reward path; only its type is read here
    from rlsp.step.reward import Reward


def needs_greedy_baseline(cfg: Any) -> bool:
    """Whether the configured estimator reads the greedy baseline (remax)."""
    return "reward_baselines_B" in estimator_uses(cfg.algorithm.adv_estimator)


def greedy_sampling(sampling: dict[str, Any]) -> dict[str, Any]:
    """The step's sampling settings turned into one greedy response per prompt (same token limits)."""
    return dataclasses.asdict(SamplingConfig(**sampling).greedy())


# The dtype of `reward_baselines`: the rollout's `response_mask` dtype (rlsp.workers.rollout_rows), as the
# estimator's other per-row inputs have it.
BASELINE_DTYPE = torch.float32


def prompts_of(uids: list[str], step_prompts: Batch, world_size: int) -> tuple[Batch, int]:
    """(one prompt row per uid of the samples' `uids`, in first-seen order, padded by repeating prompts to a
    multiple of `world_size`; the number of real prompts). The rows are those the step sent to the engines
    (`step_prompts`, rlsp.trainer.rollout_inputs.prompt_batch: ids, dataset fields, images), so nothing is read
    back from the samples' token columns."""
    rows = list(dict.fromkeys(uids))
    real = len(rows)
    where = {uid: i for i, uid in enumerate(step_prompts.meta["uid"])}
    if missing := [uid for uid in rows if uid not in where]:
        raise RuntimeError(f"greedy baseline: no prompt row kept for the samples of uid(s) {missing[:3]} "
                           f"(the step sent {len(where)} prompts)")
    rows += rows[: (-real) % world_size]
    prompts = step_prompts.select_rows([where[uid] for uid in rows])
    prompts.set("prompt_index", torch.arange(len(rows)))
    return prompts, real


def add_greedy_baselines(generate: Callable[[Batch], Any], world_size: int, reward: Reward, batch: Any,
                         step_prompts: Batch, timing: dict[str, float]) -> dict[str, float]:
    """Generate (`generate(prompts)`: the rollout engines' greedy samples, spread over `world_size` ranks) and
    score (`reward`, the samples' own reward path) one greedy response per prompt of the samples `batch` (their
    prompts from `step_prompts`, see `prompts_of`); set `reward_baselines` [B] on `batch` (each row: its prompt's
    greedy reward, matched by uid). Reads per-row values only (uid; the greedy rows' reported
    `response_tokens`). Returns the baseline metrics."""
    prompts, real = prompts_of(batch.meta["uid"], step_prompts, world_size)
    with timed("timing/gen_baseline_s", timing):
        greedy = generate(prompts).select_rows(slice(0, real))  # one row per prompt, in order; the padding dropped
    with timed("timing/reward_baseline_s", timing):
        scores = reward.score(greedy)  # the samples' reward path, so baseline and reward are comparable
    by_uid = dict(zip(greedy.meta["uid"], scores.tolist()))
    if len(by_uid) != real or len(scores) != real:
        raise RuntimeError(f"greedy baseline: expected one greedy response for each of {real} prompts, got "
                           f"{len(scores)} responses for {len(by_uid)} prompts")
    batch.set("reward_baselines", torch.tensor([by_uid[uid] for uid in batch.meta["uid"]], dtype=BASELINE_DTYPE))
    return {"reward/baseline_mean": float(scores.mean()),
            # the rollout's per-row report: the greedy rows' response_mask summed
            "reward/baseline_response_length_mean": float(greedy["response_tokens"].double().mean())}


def baseline_errors(cfg: Any) -> list[str]:
    """Why the greedy baseline cannot be produced for this config (empty when it can)."""
    if not needs_greedy_baseline(cfg):
        return []
    errors = []
    if rollout_pool_enabled(cfg):
        errors.append(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator!r} needs a greedy response per prompt "
                      "from the samples' policy; with a rollout pool (async_training) samples are generated ahead "
                      "with other weights: use the colocated trainer (no rollout pool) or another estimator")
    return errors
