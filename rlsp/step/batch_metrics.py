"""Per-step metrics computed on the driver from the rollout batch (names as verl uses them).

Each function reads on the driver only what it names through `read` (rlsp.controller.reads): per-row values
the workers reported where they exist, token-level columns only in the branches that need them.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from rlsp.algos.aggregation import masked_mean
from rlsp.algos.value_loss import explained_variance
from rlsp.controller.reads import Read, held
from rlsp.data.batch import Batch, response_lengths
from rlsp.step.stage_advantages import reported_advantage_mean, reported_critic_metrics


def _mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float(masked_mean(x, mask))


def row_tokens(batch: Batch, read: Read = held) -> torch.Tensor:
    """[B] attended tokens of each row (what balancing weighs): reported by the workers, or counted here."""
    if "num_tokens" in batch:
        return read(batch, ["num_tokens"])["num_tokens"]
    return read(batch, ["attention_mask"])["attention_mask"].sum(-1)


def _reported(batch: Batch, *keys: str) -> bool:
    """Whether the workers reported these per-row values (a step whose rows stay on the workers)."""
    return all(k in getattr(batch, "table", {}) for k in keys)


def compute_batch_metrics(batch: Batch, scores: np.ndarray, step_s: float, width: int | None = None,
                          read: Read = held) -> dict[str, float]:
    """The step's metrics, from per-row values the workers reported where the rows stay with them (the
    token-level columns are read, through `read`, only where no per-row values were reported)."""
    if _reported(batch, "response_tokens", "response_length", "num_tokens"):
        mask_tokens = batch["response_tokens"].double()
        lengths = batch["response_length"].double()
        if not width:
            read(batch, ["response_mask"])
        tokens, width = float(batch["num_tokens"].sum()), width or batch["response_mask"].shape[1]
        adv_B, adv_mean = batch.row_value("advantages"), reported_advantage_mean(batch)  # reported: rlsp.workers.step_stage
        if adv_mean is None and adv_B is not None:
            adv_mean = float((adv_B.double() * mask_tokens).sum() / mask_tokens.sum().clamp_min(1))
        elif adv_mean is None:
            read(batch, ["advantages", "response_mask"])
            adv_mean = _mean(batch["advantages"], batch["response_mask"])
    else:
        read(batch, ["response_mask", "attention_mask", "advantages"])
        mask = batch["response_mask"]
        mask_tokens = mask.sum(-1).double()
        lengths = torch.tensor(response_lengths(batch), dtype=torch.float64)  # whole trajectories (multi-turn too)
        tokens, width, adv_mean = float(batch["attention_mask"].sum()), mask.shape[1], _mean(batch["advantages"], mask)
    metrics = {
        "reward/mean": float(scores.mean()), "reward/max": float(scores.max()), "reward/min": float(scores.min()),
        "reward/accuracy": float((scores >= 1.0).mean()),
        "advantages/mean": adv_mean,
        "response_length/mean": float(lengths.mean()),
        "response_length/clip_ratio": float((lengths >= width).double().mean()),
        "throughput/tokens_per_s": tokens / max(step_s, 1e-9),
        "throughput/response_tokens": float(mask_tokens.sum()),
    }
    metrics.update(_logprob_gap(batch, read))
    if "values" in batch:
        reported = reported_critic_metrics(batch)
        metrics.update(reported if reported is not None else _critic_metrics(batch, read))
    metrics.update(compute_agent_metrics(batch, read))
    return metrics


def _logprob_gap(batch: Batch, read: Read) -> dict[str, float]:
    """|rollout - old| logprobs over response tokens, when the actor's separate pass ran (else the update
    reports the gap from its own forward)."""
    if "old_logprobs" not in batch:
        return {}
    if hasattr(batch, "source_of") and batch.source_of("old_logprobs") == "rollout_logprobs":
        return {"rollout/logprob_diff": 0.0, "rollout/logprob_diff_max": 0.0}  # the same column
    if _reported(batch, "logprob_diff_sum", "response_tokens"):
        total = batch["response_tokens"].double().sum().clamp_min(1)
        return {"rollout/logprob_diff": float(batch["logprob_diff_sum"].double().sum() / total),
                "rollout/logprob_diff_max": float(batch["logprob_diff_max"].max())}
    read(batch, ["response_mask", "rollout_logprobs", "old_logprobs"])
    mask = batch["response_mask"]
    diff = (batch["rollout_logprobs"] - batch["old_logprobs"]).abs() * mask
    return {"rollout/logprob_diff": _mean(diff, mask), "rollout/logprob_diff_max": float(diff.max())}


AGENT_MAX_KEYS = ("agent/num_turns", "agent/tool_turns", "agent/tool_calls", "agent/tool_latency_s")


def compute_agent_metrics(batch: Batch, read: Read = held) -> dict[str, float]:
    """Agent-loop rollouts: per-trajectory counts as mean/max, the engine's busy/idle seconds summed over
    workers (each row carries an even share of its worker's), rates of tool errors and parse failures."""
    rows = read(batch, ["agent_metrics"]).meta.get("agent_metrics")
    if not rows:
        return {}
    out: dict[str, float] = {}
    for key in sorted(set().union(*rows)):
        values = np.asarray([float(r.get(key, 0.0)) for r in rows])
        if key.startswith("agent/engine_"):
            out[key] = float(values.sum())
        else:
            out[f"{key}/mean"] = float(values.mean())
            if key in AGENT_MAX_KEYS:
                out[f"{key}/max"] = float(values.max())
    busy, idle = out.get("agent/engine_busy_s", 0.0), out.get("agent/engine_idle_s", 0.0)
    out["agent/engine_idle_frac"] = idle / (busy + idle) if busy + idle > 0 else 0.0
    calls = out.get("agent/tool_calls/mean", 0.0)
    if calls > 0:
        out["agent/tool_error_rate"] = out.get("agent/tool_errors/mean", 0.0) / calls
    out["agent/parse_error_rate"] = out.get("agent/parse_errors/mean", 0.0) / max(out["agent/num_turns/mean"], 1e-9)
    if "step_reward_sum" in batch:
        out["agent/step_reward/mean"] = float(read(batch, ["step_reward_sum"])["step_reward_sum"].mean())
    elif "step_rewards" in batch:
        out["agent/step_reward/mean"] = float(read(batch, ["step_rewards"])["step_rewards"].sum(-1).mean())
    return out


def _critic_metrics(batch: Batch, read: Read) -> dict[str, float]:
    read(batch, ["values", "returns", "token_level_scores", "token_level_rewards", "advantages", "response_mask"])
    values, returns, mask = batch["values"], batch["returns"], batch["response_mask"]
    return {
        "critic/score/mean": float(batch["token_level_scores"].sum(-1).mean()),
        "critic/rewards/mean": float(batch["token_level_rewards"].sum(-1).mean()),
        "critic/advantages/mean": _mean(batch["advantages"], mask),
        "critic/returns/mean": _mean(returns, mask),
        "critic/values/mean": _mean(values, mask),
        "critic/vf_explained_var": explained_variance(values, returns, mask),
    }


# Metrics that must stay finite: a NaN here means the run is training on garbage.
MUST_BE_FINITE = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy",
                  "critic/vf_loss", "critic/grad_norm", "critic/values/mean")


def check_finite(metrics: dict[str, float], step: int) -> None:
    """Stop the run at the first non-finite loss, gradient norm, value or reward, naming it."""
    bad = {k: metrics[k] for k in MUST_BE_FINITE if k in metrics and not math.isfinite(metrics[k])}
    if bad:
        raise RuntimeError(f"step {step}: non-finite {bad}; stopping instead of training on it (the optimizer "
                           "step was skipped; see reward/errors and the reward function if reward/mean is NaN)")
