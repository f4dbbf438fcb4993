"""ReMax's greedy baseline: one greedy response per prompt, scored like the samples.

For `algorithm.adv_estimator=remax` (arXiv:2310.10505) each step generates, after the samples, one
greedy (temperature 0) response per prompt with the same engines and limits, scores it with the same
reward path as the samples (rule / custom function, or the reward model), and gives every sample of
that prompt its reward as `reward_baselines` (the estimator's `reward_baselines_B`). The extra pass is
timed as `timing/gen_baseline_s` (generation) and `timing/reward_baseline_s` (scoring); the baselines'
mean reward is logged as `reward/baseline_mean` (compare with the samples' `reward/mean`).

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


# The prompt fields of a sample's meta (rlsp.trainer.rollout_inputs.prompt_batch) a greedy pass needs again.
PROMPT_META = ("uid", "data_source", "ground_truth", "extra_info", "index", "messages", "agent_name")


def prompts_of(batch: Batch, world_size: int) -> tuple[Batch, int]:
    """(one prompt row per uid of the samples `batch`, in first-seen order, padded by repeating prompts to a
    multiple of `world_size`; the number of real prompts). Prompt ids are the attended part of the left-
    padded prompt columns."""
    first: dict[str, int] = {}
    for row, uid in enumerate(batch.meta["uid"]):
        first.setdefault(uid, row)
    rows = list(first.values())
    real = len(rows)
    rows += rows[: (-real) % world_size]
    P = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
    ids, attended = batch["input_ids"][:, :P], batch["attention_mask"][:, :P].bool()
    meta = {k: [batch.meta[k][r] for r in rows] for k in PROMPT_META if k in batch.meta}
    meta["prompt_ids"] = [ids[r][attended[r]].tolist() for r in rows]
    return Batch.from_dict({"prompt_index": torch.arange(len(rows))}, meta=meta), real


def add_greedy_baselines(generate: Callable[[Batch], Batch], world_size: int, reward: Reward, batch: Batch,
                         timing: dict[str, float]) -> dict[str, float]:
    """Generate (`generate(prompts)`: the rollout engines' greedy samples, spread over `world_size` ranks) and
    score (`reward`, the samples' own reward path) one greedy response per prompt of the samples `batch`; set
    `reward_baselines` [B] on `batch` (each row: its prompt's greedy reward, matched by uid). Returns the
    baseline metrics."""
    prompts, real = prompts_of(batch, world_size)
    with timed("timing/gen_baseline_s", timing):
        greedy = generate(prompts).select_rows(slice(0, real))  # one row per prompt, in order; the padding dropped
    with timed("timing/reward_baseline_s", timing):
        scores = reward.score(greedy)  # the samples' reward path, so baseline and reward are comparable
    by_uid = dict(zip(greedy.meta["uid"], scores.tolist()))
    if len(by_uid) != real or len(scores) != real:
        raise RuntimeError(f"greedy baseline: expected one greedy response for each of {real} prompts, got "
                           f"{len(scores)} responses for {len(by_uid)} prompts")
    baselines = torch.tensor([by_uid[uid] for uid in batch.meta["uid"]], dtype=batch["response_mask"].dtype)
    batch.set("reward_baselines", baselines)
    return {"reward/baseline_mean": float(scores.mean()),
            "reward/baseline_response_length_mean": float(greedy["response_mask"].sum(-1).double().mean())}


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
