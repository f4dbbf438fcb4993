"""DAPO's dynamic sampling (arXiv:2503.14476 sec. 3.2; verl's `algorithm.filter_groups`).

A prompt group whose samples all get the same `metric` value has zero GRPO advantage everywhere: it
carries no gradient, only noise in the batch size. After scoring, such groups are dropped, and more
prompt batches (the next batches of the data stream, of `data.gen_batch_size` prompts, verl's key; null:
train_batch_size) are generated and scored until `data.train_batch_size` prompts with informative groups
are collected; the collection is then trimmed to
exactly that many prompts (the first ones collected). `max_num_gen_batches` (<= 0: no limit) bounds the
generation rounds of one step; running out of them stops the run with a RuntimeError naming the key.

The metric of a sample (verl's names): `acc` and `score`, that entry of the dict a reward function
returned, or the number it returned (verl's dapo manager records a plain number as "acc"; the reward
model's score with one);
`seq_reward`, the sum of its token-level scores (overlong shaping and tool step rewards included);
`seq_final_reward`, the sum of its token-level rewards (equal to seq_reward: validation refuses it with
the in-reward KL penalty, which is applied after filtering). A group of one sample is always kept.

The filter reads per-row values only (`ROW_PARTS`): the reward function's values and entries, and for the
seq_* metrics the token scores' row sums from the parts they are built of (rlsp.rewards.token_scores
.shaped_row_sums: the row's reward, its overlong penalty, the reward model's row score, the step rewards'
sum the rollout reports), never the [rows x response] columns, so the driver's bytes per row do not grow
with the response length. The kept rows keep the token scores' build: they are built on the workers, or on
the driver only where it reads them (rlsp.controller.step_data.StepData.derive).

Synchronous trainer: every round generates one data batch on the rollout engines. Asynchronous trainer
(rollout pool): units come from the pool's queue; a unit taken beyond the step's `require_batches` to
replace filtered groups is not counted against the staleness bound (the queue may run that many units
further ahead). Either way the data position advances over every batch consumed, so a checkpoint
resumes after them.

Logged per step: train/num_gen_batches (generation rounds, in data batches), train/num_groups_kept and
train/num_groups_filtered (informative and dropped groups among those generated), train/num_groups_trimmed
(informative groups beyond train_batch_size, dropped by the trim), plus reward/errors over every round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from rlsp.config.choices import FILTER_GROUP_METRICS
from rlsp.controller.reads import Read, held
from rlsp.data.batch import Batch
from rlsp.rewards.token_scores import shaped_row_sums
from rlsp.utils.timing import timed

if TYPE_CHECKING:  # only its type is read here
    from rlsp.step.reward import Reward

Generate = Callable[[list[dict[str, Any]], int], Batch]  # (prompt items, index of the first) -> their samples



class _Call(Protocol):
    def result(self) -> Batch: ...


class Unit(Protocol):
    """A unit the asynchronous trainer's pool generates (rlsp.trainer.async_trainer.InFlight)."""

    call: _Call


U = TypeVar("U", bound=Unit)

LIMIT_KEY = "algorithm.filter_groups.max_num_gen_batches"
# The per-row values the seq_* metrics read: the row's policy tokens and the parts of its token-level scores
# (rule reward, the reward model's row score, dapo's overlong penalty, the step rewards on its policy tokens).
ROW_PARTS = ("response_tokens", "row_reward", "rm_score", "overlong_reward", "step_reward_policy_sum")


def _reward_entry(metric: str, batch: Batch, scores_B: np.ndarray) -> np.ndarray:
    """acc / score of each row: the entry of a reward function's returned dict, else its number (verl's dapo
    manager records a plain number as "acc"; a dict always holds "score")."""
    extras = batch.meta.get("reward_extra_info") or [{}] * len(batch)
    values = []
    for score, extra in zip(scores_B, extras):
        if not extra:
            values.append(float(score))
        elif metric in extra:
            values.append(float(extra[metric]))
        else:
            raise RuntimeError(f"algorithm.filter_groups.metric={metric!r}: the reward function returned a dict "
                               f"without {metric!r} (keys: {sorted(extra)}); return it, or filter on metric=score")
    return np.asarray(values, dtype=np.float64)


def _held(batch: Any, key: str) -> bool:
    """Whether the driver holds tensor column `key` of `batch` (a Batch, or a StepData's own table)."""
    return key in getattr(batch, "table", batch).tensors.keys()


def seq_rewards(batch: Any, step_rewards: bool = False) -> np.ndarray:
    """[B] float64 sums of each row's token-level scores (verl's seq_reward): the driver's own scores where it
    holds them (a Batch), else from the rows' per-row parts (`ROW_PARTS`); `step_rewards`: the scores hold the
    agent loop's step rewards (multi_turn.use_step_rewards, rlsp.step.reward.Reward)."""
    if _held(batch, "token_level_scores"):
        return batch["token_level_scores"].sum(-1).double().numpy()
    if "row_reward" not in batch and "rm_score" not in batch:
        raise RuntimeError(f"dynamic sampling found no per-row scores in the rows (they have {sorted(batch.keys())}): "
                           "score them first (row_reward, or the reward model's rm_score)")
    step = step_rewards and "step_rewards" in batch
    if step and "step_reward_policy_sum" not in batch:
        raise RuntimeError("dynamic sampling with multi_turn.use_step_rewards needs the rollout's per-row "
                           f"step_reward_policy_sum (the rows have {sorted(batch.keys())})")
    part = lambda key: batch[key] if key in batch else None  # noqa: E731
    sums_B = shaped_row_sums(batch["response_tokens"], part("row_reward"), part("rm_score"), part("overlong_reward"),
                             batch["step_reward_policy_sum"] if step else None)  # rm_score before row_reward
    return sums_B.double().numpy()


def sample_metric(metric: str, batch: Batch, scores_B: np.ndarray, step_rewards: bool = False) -> np.ndarray:
    """[B] values of `metric` (see the module docstring) for the scored rows of `batch`; `step_rewards` as in
    `seq_rewards`."""
    if metric in ("acc", "score"):
        return _reward_entry(metric, batch, scores_B)
    if metric == "seq_final_reward" and _held(batch, "token_level_rewards"):
        return batch["token_level_rewards"].sum(-1).double().numpy()
    if metric in ("seq_reward", "seq_final_reward"):  # the token rewards are the scores until after filtering
        return seq_rewards(batch, step_rewards)
    raise ValueError(f"algorithm.filter_groups.metric={metric!r}; legal values: {list(FILTER_GROUP_METRICS)}")


def informative_groups(uids: list[str], values_B: np.ndarray) -> tuple[list[str], list[str]]:
    """(kept, dropped) group uids in order of first appearance: a group is kept when its values differ
    (standard deviation > 0) or it has a single sample."""
    groups: dict[str, list[float]] = {}
    for uid, value in zip(uids, values_B):
        groups.setdefault(uid, []).append(float(value))
    kept = [u for u, vals in groups.items() if len(vals) == 1 or float(np.std(vals)) > 0]
    return kept, [u for u in groups if u not in set(kept)]


@dataclass
class GroupCollector:
    """Informative groups of one training step, collected over generation rounds."""

    metric: str
    prompts_needed: int  # data.train_batch_size
    prompts_per_batch: int  # prompts in one generation batch (a data batch)
    max_num_gen_batches: int  # <= 0: no limit
    parts: list[Batch] = field(default_factory=list)
    kept_uids: list[str] = field(default_factory=list)
    generated_prompts: int = 0
    filtered: int = 0
    errors: int = 0
    read: Read = held  # worker-held columns to the driver (rlsp.controller.reads)
    step_rewards: bool = False  # the token scores hold the agent loop's step rewards (seq_* metrics)

    @property
    def ready(self) -> bool:
        return len(self.kept_uids) >= self.prompts_needed

    @property
    def num_gen_batches(self) -> float:
        return self.generated_prompts / self.prompts_per_batch

    def add(self, batch: Batch, scores_B: np.ndarray, errors: int = 0) -> None:
        """Keep the informative groups of a scored batch; `scores_B` are the reward function's values."""
        if self.metric.startswith("seq_"):  # per-row values only (ROW_PARTS); the driver holds them already
            self.read(batch, [k for k in ROW_PARTS if k in batch])
        uids = list(batch.meta["uid"])
        kept, dropped = informative_groups(uids, sample_metric(self.metric, batch, scores_B, self.step_rewards))
        keep = set(kept)
        batch.meta["row_score"] = [float(s) for s in scores_B]  # train_on reads them instead of scoring again
        self.parts.append(batch.select_rows([i for i, u in enumerate(uids) if u in keep]))
        self.kept_uids += kept
        self.generated_prompts += len(kept) + len(dropped)
        self.filtered += len(dropped)
        self.errors += errors

    def check_limit(self) -> None:
        """Raise once max_num_gen_batches rounds were generated without enough informative groups."""
        limit = self.max_num_gen_batches
        if not self.ready and limit > 0 and self.num_gen_batches >= limit:
            raise RuntimeError(
                f"dynamic sampling: {self.num_gen_batches:g} generation batches ({LIMIT_KEY}={limit}) gave "
                f"{len(self.kept_uids)} prompts with informative groups of the {self.prompts_needed} a step needs "
                f"({self.filtered} groups had the same {self.metric!r} for every sample); the prompts may be too "
                f"hard or too easy: raise {LIMIT_KEY}, or set it to 0 for no limit")

    def take(self) -> tuple[Batch, dict[str, float]]:
        """The first `prompts_needed` informative groups as one batch, and the step's sampling metrics."""
        chosen = set(self.kept_uids[: self.prompts_needed])
        batch = type(self.parts[0]).concat(self.parts)
        batch = batch.select_rows([i for i, u in enumerate(batch.meta["uid"]) if u in chosen])
        metrics = {"train/num_gen_batches": float(self.num_gen_batches),
                   "train/num_groups_kept": float(len(self.kept_uids)),
                   "train/num_groups_filtered": float(self.filtered),
                   "train/num_groups_trimmed": float(len(self.kept_uids) - len(chosen)),
                   "reward/errors": float(self.errors)}
        return batch, metrics


class DynamicSampler:
    """Collects a step's informative groups for the synchronous and the asynchronous trainer."""

    def __init__(self, metric: str, train_batch_size: int, max_num_gen_batches: int,
                 gen_batch_size: int | None = None) -> None:
        if metric not in FILTER_GROUP_METRICS:
            raise ValueError(f"algorithm.filter_groups.metric={metric!r}; legal values: {list(FILTER_GROUP_METRICS)}")
        self.metric, self.train_batch_size, self.max_num_gen_batches = metric, train_batch_size, max_num_gen_batches
        self.gen_batch_size = gen_batch_size or train_batch_size  # prompts per generation round (data batch)

    def collector(self, read: Read = held, step_rewards: bool = False) -> GroupCollector:
        return GroupCollector(self.metric, self.train_batch_size, self.gen_batch_size, self.max_num_gen_batches,
                              read=read, step_rewards=step_rewards)

    def collect(self, generate: Generate, reward: Reward, items: list[dict[str, Any]], batches: Iterator,
                timing: dict[str, float], read: Read = held) -> tuple[Batch, dict[str, float]]:
        """Generate (`generate(items, first_index)`) and score (`reward`) data batches -- the first is `items`,
        then the next ones of `batches` -- until the step has train_batch_size prompts with informative groups;
        `read` brings the worker-held columns the filter reads to the driver."""
        collector, first_index = self.collector(read, reward.step_rewards), 0
        while True:
            with timed("timing/gen_s", timing):
                # Continuing prompt indices: each round's samples get seeds of their own.
                batch = generate(items, first_index)
            with timed("timing/reward_s", timing):
                scores = reward.score(batch)
            collector.add(batch, scores, reward.last_errors)
            if collector.ready:
                return collector.take()
            collector.check_limit()
            first_index += len(items)
            items = _next_batch(batches, collector)

    def collect_units(self, take_unit: Callable[[bool], U], units_per_step: int, reward: Reward,
                      timing: dict[str, float], read: Read = held
                      ) -> tuple[list[U], list[Batch], Batch, dict[str, float]]:
        """Take the pool's units (`take_unit(extra)`: the next one; `extra` when it replaces filtered groups, so
        beyond the step's `units_per_step`) until the step has train_batch_size prompts with informative groups:
        (units taken, their batches, the trimmed batch, the sampling metrics)."""
        collector = self.collector(read, reward.step_rewards)
        units: list[U] = []
        parts: list[Batch] = []
        while not collector.ready:
            extra = len(units) >= units_per_step  # replaces filtered groups: outside the staleness bound
            if extra:
                collector.check_limit()
            units.append(take_unit(extra))
            parts.append(units[-1].call.result())
            with timed("timing/reward_s", timing):
                scores = reward.score(parts[-1])
            collector.add(parts[-1], scores, reward.last_errors)
        batch, metrics = collector.take()
        return units, parts, batch, metrics


def _next_batch(batches: Iterator, collector: GroupCollector) -> list[dict[str, Any]]:
    try:
        return next(batches)
    except StopIteration:
        raise RuntimeError(f"dynamic sampling: the training data ran out after {collector.num_gen_batches:g} "
                           f"generation batches with {len(collector.kept_uids)} of {collector.prompts_needed} "
                           "informative groups") from None


def build_dynamic_sampler(cfg: Any) -> DynamicSampler | None:
    """The sampler of algorithm.filter_groups, or None when dynamic sampling is off."""
    fg = cfg.algorithm.filter_groups
    if not fg.enable:
        return None
    gen = cfg.data.gen_batch_size
    return DynamicSampler(str(fg.metric), int(cfg.data.train_batch_size), int(fg.max_num_gen_batches),
                          None if gen is None else int(gen))

