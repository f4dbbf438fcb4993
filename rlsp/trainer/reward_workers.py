"""Rule scoring over `reward_model.num_workers` concurrent processes (verl's reward-loop workers).

With num_workers = k > 1 the driver's rule/custom reward scoring is split into k contiguous chunks of
the batch, each scored by one of k Ray actors holding its own `Scorer` (the policy tokenizer and the
reward function, loaded once per actor); the chunks' token-level scores are concatenated back in
order, so the result is the one a single `Scorer` gives. With a reward model the model's inputs are
rendered on the workers that host it (rlsp.workers.roles.reward_loop); rule rewards then score
validation only (verl's rule).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import ray
import torch

from rlsp.data.batch import Batch
from rlsp.trainer.scoring import Scorer


@ray.remote(num_cpus=0)
class RewardLoopWorker:
    """One reward-loop process: a Scorer of its own."""

    def __init__(self, tokenizer_path: str, custom_path: str | None, custom_name: str, on_error: str) -> None:
        from transformers import AutoTokenizer  # noqa: PLC0415 -- in the actor's process

        self.scorer = Scorer(AutoTokenizer.from_pretrained(tokenizer_path), custom_path, custom_name, on_error)

    def score_rows(self, batch: Batch) -> tuple[torch.Tensor, np.ndarray, int, list[dict[str, Any]]]:
        scores = self.scorer.score_rows(batch)
        return batch["token_level_scores"], scores, self.scorer.last_errors, batch.meta["reward_extra_info"]


class RewardWorkerPool:
    """Scorer's interface (`score_rows`, `last_errors`) over `num_workers` Ray actors, started on first use."""

    def __init__(self, num_workers: int, tokenizer_path: str, custom_path: str | None, custom_name: str,
                 on_error: str) -> None:
        if num_workers < 2:
            raise ValueError(f"reward_model.num_workers={num_workers}: a pool needs >= 2 workers (1 scores in the driver)")
        self.num_workers = num_workers
        self.args = (tokenizer_path, custom_path, custom_name, on_error)
        self.workers: list[Any] = []
        self.last_errors = 0

    def score_rows(self, batch: Batch) -> np.ndarray:
        """Adds `token_level_scores` [B, R] and meta `reward_extra_info` to the batch; returns the per-row scores."""
        if not self.workers:
            self.workers = [RewardLoopWorker.remote(*self.args) for _ in range(self.num_workers)]
        chunks = batch.split(max(1, -(-len(batch) // self.num_workers)))  # at most num_workers contiguous parts
        results = ray.get([w.score_rows.remote(c) for w, c in zip(self.workers, chunks)])
        batch.set("token_level_scores", torch.cat([r[0] for r in results]))
        batch.meta["reward_extra_info"] = [extra for r in results for extra in r[3]]
        self.last_errors = sum(r[2] for r in results)
        return np.concatenate([r[1] for r in results])


def build_scorer(num_workers: int, tokenizer: Any, tokenizer_path: str, custom_path: str | None, custom_name: str,
                 on_error: str) -> Scorer | RewardWorkerPool:
    """The driver's rule scorer: in-process for one worker, else a pool of reward-loop actors."""
    if num_workers <= 1:
        return Scorer(tokenizer, custom_path, custom_name, on_error=on_error)
    return RewardWorkerPool(num_workers, tokenizer_path, custom_path, custom_name, on_error)
