"""Rule scoring in `reward_model.num_workers` scoring processes (verl's reward-loop workers), or with 0 in
the policy workers themselves, where the rows are read from the workers that hold them, never through
the driver.

Each of the k Ray actors holds its own `Scorer` (the policy tokenizer and the reward function, loaded
once per actor; started with the run so the first step does not wait for them). A step's rows are
split into k contiguous chunks; each actor receives its chunk's declared columns (`SCORE_READS`)
straight from the blocks that hold them (rlsp.controller.step_data) and returns one score per row, the
reward function's dict entries and its error count. The driver keeps the scores; the token-level
scores (the score on each row's last policy token) are built only where they are read. With a reward
model the model's inputs are rendered on the workers that host it (rlsp.workers.roles.reward_loop);
rule rewards then score validation only (verl's rule).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import ray
import torch

from rlsp.controller.step_data import StepData, from_batch
from rlsp.controller.traffic import TRAFFIC
from rlsp.controller.worker_group import gather_or_name
from rlsp.data.batch import Batch
from rlsp.rewards.scoring import RewardError, Scorer, place_scores
from rlsp.workers.columns import RowsSpec, assemble

# What rule scoring reads of a row: the response tokens and the dataset row's fields.
SCORE_READS = ("input_ids", "attention_mask", "response_mask", "data_source", "ground_truth", "extra_info", "index")


@ray.remote(num_cpus=0)
class ScoringActor:
    """One rule-scoring process: a Scorer of its own (not the reward loop, which serves a reward model)."""

    def __init__(self, tokenizer_path: str, custom_path: str | None, custom_name: str, on_error: str,
                 row_extra: dict[str, Any] | None = None) -> None:
        from transformers import AutoTokenizer  # noqa: PLC0415 -- in the actor's process

        self.scorer = Scorer(AutoTokenizer.from_pretrained(tokenizer_path), custom_path, custom_name, on_error,
                             row_extra)

    def score(self, spec: RowsSpec, *blocks: Batch) -> tuple[np.ndarray, int, list[dict[str, Any]]]:
        return self.scorer.score_report(assemble(spec, blocks))


class ScoringPool:
    """Scores the rows of a step (`score_rows`) in contiguous chunks over its scorers: scoring processes
    (`ScoringActor`) or, with reward_model.num_workers=0, the policy workers (rlsp.workers.worker's
    `score`, the same call and answer)."""

    def __init__(self, scorers: list[Any], name_of: Callable[[int], str] | None = None) -> None:
        """`name_of(i)` names scorer i when it dies (default: "scoring process i of k")."""
        if not scorers:
            raise ValueError("a scoring pool needs at least one scorer (a scoring process or a policy worker)")
        self.workers = scorers
        self.name_of = name_of or (lambda i: f"scoring process {i} of {len(scorers)}")
        self.last_errors = 0

    def score_rows(self, data: StepData | Batch) -> np.ndarray:
        """The per-row scores of `data`'s rows; sets meta `reward_extra_info`, the scores (`row_score`,
        `row_reward`: the score as the token rewards hold it) and the lazily built `token_level_scores`."""
        if isinstance(data, Batch):  # rows the driver holds (validation of a scorer, tests): scored in place
            step = from_batch(data)
            scores = self.score_rows(step)
            data.set("token_level_scores", step["token_level_scores"])
            data.meta["reward_extra_info"] = step.meta["reward_extra_info"]
            return scores
        size = max(1, -(-len(data) // len(self.workers)))  # at most num_workers contiguous chunks
        chunks = [range(a, min(a + size, len(data))) for a in range(0, len(data), size)]
        calls = []
        for worker, rows in zip(self.workers, chunks):
            spec, refs = data.spec(rows, SCORE_READS)
            TRAFFIC.send(spec)
            calls.append(worker.score.remote(spec, *refs))
        TRAFFIC.call("reward.score", len(calls))
        TRAFFIC.wait()
        try:
            results = gather_or_name(calls, self.name_of)  # a scorer that dies is named (WorkerDiedError)
        except ray.exceptions.RayTaskError as exc:  # a reward function's fault, as if it had run here
            cause = getattr(exc, "cause", None)
            if isinstance(cause, RewardError):
                raise RewardError(str(cause)) from None
            raise
        TRAFFIC.receive(*results)
        scores = np.concatenate([r[0] for r in results])
        self.last_errors = sum(r[1] for r in results)
        data.meta["reward_extra_info"] = [extra for r in results for extra in r[2]]
        set_row_scores(data, scores)
        return scores


def set_row_scores(data: StepData, scores: np.ndarray) -> None:
    """Rule scores as the driver keeps them: per row, and `token_level_scores` built when first read."""
    data.set("row_reward", torch.as_tensor(scores, dtype=torch.float32))
    by_id = dict(zip(data.ids, scores))  # row-wise: a selection of the rows builds its own (StepData.derive)
    data.derive("token_level_scores", lambda d: place_scores(np.asarray([by_id[i] for i in d.ids]), d["response_mask"]))


def start_scoring_processes(num_workers: int, tokenizer_path: str, custom_path: str | None, custom_name: str,
                            on_error: str, row_extra: dict[str, Any] | None = None) -> list[Any]:
    """`num_workers` scoring processes, started now so they load while the training workers do (none for 0);
    `row_extra`: what the reward manager adds to every row's extra_info."""
    return [ScoringActor.remote(tokenizer_path, custom_path, custom_name, on_error, row_extra)
            for _ in range(num_workers)]
