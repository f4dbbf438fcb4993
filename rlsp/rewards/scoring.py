"""Score rollout rows: decode each response and call the rule reward of its data_source (or a custom fn).

The scalar score is placed on the last response token (`token_level_scores`), as outcome rewards are.
With a reward model (reward_model.enable) its scores take that place in training (`apply_rm_scores`).
A reward function that raises, or returns something that is not a finite number, is reported with the
offending row (data_source, dataset index) and stops the run (`reward.on_error=raise`), or scores 0
and is counted in `reward/errors` (`reward.on_error=zero`) — never a silent NaN.

As in verl, a reward function may return a dict instead of a number: its "score" (a finite number) is
the reward, and all its entries (e.g. named reward components for algorithm.adv_estimator=gdpo) are
kept per row in `batch.meta["reward_extra_info"]` (a dict per row; empty for a plain number).

The reward manager (`reward.reward_manager.name`) may add entries to every row's extra_info before the call:
verl's gdpo manager adds the run's `experiment_name` (verl's rlla reward function reads it), otherwise it
scores as naive does (`manager_extra_info`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rlsp.data.batch import Batch, last_policy_token, response_lengths
from rlsp.rewards.loader import load_custom_reward_fn
from rlsp.rewards.registry import get_reward_fn
from rlsp.utils.logging import get_logger

log = get_logger("rlsp.reward")


class RewardError(RuntimeError):
    pass


def manager_extra_info(manager: str, experiment_name: str) -> dict[str, Any]:
    """What reward manager `manager` adds to every row's extra_info: the gdpo manager the experiment's name."""
    return {"experiment_name": experiment_name} if manager == "gdpo" else {}


class Scorer:
    def __init__(self, tokenizer, custom_path: str | None = None, custom_name: str = "compute_score",
                 on_error: str = "raise", row_extra: dict[str, Any] | None = None) -> None:
        """`row_extra`: entries added to every row's extra_info (`manager_extra_info`)."""
        if on_error not in ("raise", "zero"):
            raise ValueError(f"reward.on_error={on_error!r}; legal values: ['raise', 'zero']")
        self.tokenizer = tokenizer
        self.row_extra = dict(row_extra or {})
        self.custom_fn = load_custom_reward_fn(custom_path, custom_name) if custom_path else None
        self.on_error = on_error
        self.last_errors = 0

    def decode_responses(self, batch: Batch) -> list[str]:
        P = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
        lengths = response_lengths(batch)  # multi-turn: every turn, tool output included (as verl decodes)
        ids = batch["input_ids"][:, P:]
        return [self.tokenizer.decode(ids[i, : lengths[i]].tolist(), skip_special_tokens=True) for i in range(len(batch))]

    def _fn(self, data_source: str) -> Callable[..., Any]:
        return self.custom_fn if self.custom_fn is not None else get_reward_fn(data_source)

    def _score_one(self, source: str, text: str, truth: Any, extra: Any, index: Any) -> tuple[float, dict[str, Any]]:
        """(score, the returned dict's entries, score included; {} for a plain number) of one row."""
        fn = self._fn(source)
        where = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)} on data_source={source!r}"
        try:
            value = fn(source, text, truth, extra)
        except Exception as exc:
            problem = f"raised {type(exc).__name__}: {exc}"
        else:
            score, rest = (value.get("score"), value) if isinstance(value, dict) else (value, {})
            if isinstance(score, (bool, int, float, np.number)) and math.isfinite(float(score)):
                return float(score), dict(rest)
            need = "a dict reward needs a finite number under 'score'" if isinstance(value, dict) else "a reward must be a finite number"
            problem = f"returned {value!r} ({need})"
        message = f"reward function {where}, row index={index} (response {text[:80]!r}) {problem}"
        if self.on_error == "raise":
            raise RewardError(message + "; set reward.on_error=zero to score such rows 0 and count them")
        log.warning("%s; scored 0 (reward.on_error=zero)", message)
        self.last_errors += 1
        return 0.0, {}

    def score_rows(self, batch: Batch) -> np.ndarray:
        """Adds `token_level_scores` [B, R] and meta `reward_extra_info` to the batch; returns the per-row scores."""
        texts = self.decode_responses(batch)
        sources, truths = batch.meta["data_source"], batch.meta["ground_truth"]
        extras = batch.meta.get("extra_info", [None] * len(batch))
        if self.row_extra:
            extras = [{**(extra or {}), **self.row_extra} for extra in extras]
        indices = batch.meta.get("index", [None] * len(batch))
        self.last_errors = 0
        scored = [self._score_one(*row) for row in zip(sources, texts, truths, extras, indices)]
        scores = [score for score, _ in scored]
        batch.meta["reward_extra_info"] = [rest for _, rest in scored]
        batch.set("token_level_scores", place_scores(scores, batch["response_mask"]))
        return np.asarray(scores, dtype=np.float64)

    def score_report(self, batch: Batch) -> tuple[np.ndarray, int, list[dict[str, Any]]]:
        """What a scoring process returns for its rows: (scores, failed reward calls, each row's dict entries)."""
        scores = self.score_rows(batch)
        return scores, self.last_errors, batch.meta["reward_extra_info"]


def place_scores(scores: Any, mask_BR: torch.Tensor) -> torch.Tensor:
    """[B, R] token-level scores: each row's score on its last policy token, zeros elsewhere."""
    token_scores = torch.zeros_like(mask_BR)
    token_scores[torch.arange(len(mask_BR)), last_policy_token(mask_BR)] = torch.tensor(scores, dtype=mask_BR.dtype)
    return token_scores * mask_BR


def apply_rm_scores(batch: Batch) -> np.ndarray:
    """verl's rule with a reward model: its score (`rm_scores`, on the last response token) is the token-level
    score, and training rows get no rule reward (verl's reward manager returns rm_scores when present; rule and
    custom rewards then score validation only). Returns the per-row scores."""
    if "rm_row_reward" in batch and hasattr(batch, "derive"):  # reported per row where the scores were computed
        batch.set("row_reward", batch["rm_row_reward"])
        batch.derive("token_level_scores", lambda rows: rows["rm_scores"])
        return batch["rm_score"].double().numpy()
    batch.set("token_level_scores", batch["rm_scores"])
    return batch["rm_scores"].sum(-1).double().numpy()
