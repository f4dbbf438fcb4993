"""Score rollout rows: decode each response and call the rule reward of its data_source (or a custom fn).

The scalar score is placed on the last response token (`token_level_scores`), as outcome rewards are.
"""

from __future__ import annotations

import numpy as np
import torch

from rlsp.data.batch import Batch
from rlsp.rewards.loader import load_custom_reward_fn
from rlsp.rewards.registry import score_batch


class Scorer:
    def __init__(self, tokenizer, custom_path: str | None = None, custom_name: str = "compute_score") -> None:
        self.tokenizer = tokenizer
        self.custom_fn = load_custom_reward_fn(custom_path, custom_name) if custom_path else None

    def decode_responses(self, batch: Batch) -> list[str]:
        P = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
        lengths = batch["response_mask"].sum(-1).long().tolist()
        ids = batch["input_ids"][:, P:]
        return [self.tokenizer.decode(ids[i, : lengths[i]].tolist(), skip_special_tokens=True) for i in range(len(batch))]

    def score_rows(self, batch: Batch) -> np.ndarray:
        """Adds `token_level_scores` [B, R] to the batch; returns the per-row scores."""
        texts = self.decode_responses(batch)
        sources, truths = batch.meta["data_source"], batch.meta["ground_truth"]
        extras = batch.meta.get("extra_info", [None] * len(batch))
        if self.custom_fn is not None:
            scores = [float(self.custom_fn(s, t, g, e)) for s, t, g, e in zip(sources, texts, truths, extras)]
        else:
            scores = score_batch(sources, texts, truths, extras)
        mask = batch["response_mask"]
        token_scores = torch.zeros_like(mask)
        last = (mask.sum(-1).long() - 1).clamp_min(0)
        token_scores[torch.arange(len(batch)), last] = torch.tensor(scores, dtype=mask.dtype)
        batch.set("token_level_scores", token_scores * mask)
        return np.asarray(scores, dtype=np.float64)
