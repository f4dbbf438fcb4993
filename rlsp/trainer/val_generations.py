"""verl's `trainer.log_val_generations=N`: the first N samples of every validation (prompt, response, score).

verl shows them in its loggers; rlsp appends them as JSON lines to <trainer.default_local_dir>/val_generations.jsonl,
one line per sample with the validation's number (0 = the first validation of this run), so a run's answers can be
read side by side across validations. Off (no file) with N = 0, verl's default.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from rlsp.data.batch import Batch, response_lengths

FILE_NAME = "val_generations.jsonl"


class ValGenerationLog:
    reads = ("input_ids", "response_mask", "attention_mask")  # what `write` reads of the rows

    def __init__(self, path: str, num_samples: int, tokenizer: Any) -> None:
        self.path, self.num_samples, self.tokenizer = path, num_samples, tokenizer
        self.validations = 0  # validations written by this run

    @classmethod
    def build(cls, cfg: Any, tokenizer: Any) -> ValGenerationLog | None:
        n = int(cfg.trainer.log_val_generations)
        return cls(os.path.join(cfg.trainer.default_local_dir, FILE_NAME), n, tokenizer) if n > 0 else None

    def records(self, batch: Batch, scores: np.ndarray) -> list[dict[str, Any]]:
        """The first num_samples rows of `batch` (validation rows, each prompt's samples contiguous) as text."""
        rows = min(self.num_samples, len(batch))
        P = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
        lengths = response_lengths(batch)  # multi-turn: every turn, as the reward reads it
        out = []
        for i in range(rows):
            prompt_ids = batch["input_ids"][i, :P][batch["attention_mask"][i, :P].bool()]  # prompts are left-padded
            response_ids = batch["input_ids"][i, P: P + int(lengths[i])]
            out.append({"validation": self.validations, "sample": i,
                        "prompt": self.tokenizer.decode(prompt_ids.tolist(), skip_special_tokens=True),
                        "response": self.tokenizer.decode(response_ids.tolist(), skip_special_tokens=True),
                        "score": float(scores[i])})
        return out

    def write(self, batch: Batch, scores: np.ndarray) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a") as f:
            for record in self.records(batch, scores):
                f.write(json.dumps(record) + "\n")
        self.validations += 1
