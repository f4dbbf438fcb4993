"""Start-up check of rollout tensor parallelism (`actor_rollout_ref.rollout.tensor_model_parallel_size`).

With tp = k > 1, k consecutive ranks of the rollout pool (the policy workers, or a rollout pool of
their own) run one vLLM engine together: vLLM joins the training world (`external_launcher`) and
carves tp groups of k out of it, each rank holding 1/k of every layer's weights. A tp group's ranks
must share a node (their all-reduces run every layer) and receive the same prompts (the rollout
role's `generate` is dispatched by dp group of the rollout layout). Head counts are checked against
the model in `rlsp.rollout.support` (preflight), where the model config is read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlsp.config.layout import ParallelLayout

KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_rollout_tp(cfg: Any, layout: ParallelLayout | None, errors: list[str]) -> ParallelLayout | None:
    """The layout with its rollout tp degree, after checking it fits the rollout pool and the engine."""
    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        errors.append(f"{KEY}={tp!r} must be an integer >= 1")
        return layout
    if tp == 1 or layout is None:
        return layout
    n_err = len(errors)
    name = cfg.actor_rollout_ref.rollout.name
    if name != "vllm":
        errors.append(f"{KEY}={tp} needs actor_rollout_ref.rollout.name=vllm (got {name!r}: Hugging Face generate "
                      "runs one whole model per worker); legal with hf: 1")
    pool = layout.rollout or layout.policy
    where = "rollout.n_gpus_per_node" if layout.rollout is not None else "trainer.n_gpus_per_node"
    if pool.procs_per_node % tp:
        errors.append(f"{KEY}={tp} must divide the {pool.procs_per_node} rollout workers per node ({where}): an "
                      f"engine's ranks all-reduce every layer and stay inside a node; legal values: "
                      f"{_divisors(pool.procs_per_node)}")
    if len(errors) > n_err:
        return layout
    return dataclasses.replace(layout, rollout_tp=tp)
