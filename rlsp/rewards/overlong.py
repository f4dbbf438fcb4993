"""DAPO's overlong reward shaping (arXiv:2503.14476, eq. 13): the `dapo` reward manager's length penalty.

With L_max = max_resp_len and L_cache = the buffer length, a response of L tokens gets

    R_length(L) = 0                                          L <= L_max - L_cache
                = ((L_max - L_cache) - L) / L_cache * factor  L_max - L_cache < L <= L_max
                = -factor                                     L > L_max

added to its reward (eq. 13 has factor 1; verl's `penalty_factor` scales it). L counts every response
token, tool output of multi-turn rows included (as the reward is decoded). The penalty joins the
row's score on its last policy token, where outcome rewards are placed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlsp.config.run_spec import resolved_max_resp_len
from rlsp.data.batch import Batch, last_policy_token, response_lengths


def compute_overlong_penalty(lengths_B: torch.Tensor, max_resp_len: int, buffer_len: int,
                             penalty_factor: float) -> torch.Tensor:
    """[B] float64 penalties (<= 0) of responses of `lengths_B` tokens (eq. 13 above)."""
    if buffer_len < 1 or buffer_len > max_resp_len:
        raise ValueError(f"overlong buffer len={buffer_len} must be in [1, max_resp_len={max_resp_len}]")
    exceed_B = lengths_B.double() - (max_resp_len - buffer_len)
    return (-exceed_B / buffer_len * penalty_factor).clamp(min=-penalty_factor, max=0.0)


@dataclass(frozen=True)
class OverlongShaping:
    """The dapo manager's shaping of a scored batch (reward.reward_kwargs.overlong_buffer_cfg)."""

    max_resp_len: int
    buffer_len: int
    penalty_factor: float
    log: bool = False

    def apply(self, batch: Batch) -> torch.Tensor:
        """Add each row's penalty to `token_level_scores` (on its last policy token) and keep it as the
        `overlong_reward` column (for the metrics of the rows finally trained on); returns it."""
        lengths_B = torch.tensor(response_lengths(batch))
        penalty_B = compute_overlong_penalty(lengths_B, self.max_resp_len, self.buffer_len, self.penalty_factor)
        scores_BR = batch["token_level_scores"].clone()
        mask_BR = batch["response_mask"]
        rows = torch.arange(len(batch))
        scores_BR[rows, last_policy_token(mask_BR)] += penalty_B.to(scores_BR.dtype)
        batch.set("token_level_scores", scores_BR * (mask_BR > 0))  # a row without policy tokens gets nothing
        batch.set("overlong_reward", penalty_B)
        return penalty_B

    def metrics(self, batch: Batch) -> dict[str, float]:
        """With `log`: the mean penalty and the fraction of penalised rows (verl's overlong_reward / overlong)."""
        if not self.log or "overlong_reward" not in batch:
            return {}
        penalty_B = batch["overlong_reward"]
        return {"reward/overlong_reward/mean": float(penalty_B.mean()),
                "reward/overlong/ratio": float((penalty_B < 0).double().mean())}


def build_overlong_shaping(cfg: Any) -> OverlongShaping | None:
    """The shaping of reward.reward_manager.name=dapo with reward.reward_kwargs.overlong_buffer_cfg.enable, else
    None (the naive manager, or dapo without the buffer: plain per-row scores)."""
    buf = cfg.reward.reward_kwargs.overlong_buffer_cfg
    if cfg.reward.reward_manager.name != "dapo" or not buf.enable:
        return None
    return OverlongShaping(resolved_max_resp_len(cfg), int(buf.len), float(buf.penalty_factor), bool(buf.log))
