"""Start-up check of rollout tensor parallelism (`actor_rollout_ref.rollout.tensor_model_parallel_size`).

With tp = k > 1, k consecutive ranks of the rollout pool (the policy workers, or a rollout pool of
their own) run one vLLM engine together: vLLM joins the training world (`external_launcher`) and
carves tp groups of k out of it, each rank holding 1/k of every layer's weights. A tp group's ranks
must share a node (their all-reduces run every layer) and receive the same prompts (the rollout
role's `generate` is dispatched by dp group of the rollout layout). Head counts are checked against
the model in `rlsp.rollout.support` (preflight), where the model config is read.
"""

from __future__ import annotations

from typing import Any

from rlsp.config.layout import World
from rlsp.utils.divisors import divisors

KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"


def check_rollout_tp(cfg: Any, pool: World | None, separate_pool: bool, errors: list[str]) -> int:
    """The rollout tp degree (the layout's `rollout_tp`), after checking it fits the engine and `pool` (the
    rollout pool, or the policy pool when the engines run on the policy workers; None: not valid itself)."""
    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        errors.append(f"{KEY}={tp!r} must be an integer >= 1")
        return 1
    if tp == 1 or pool is None:
        return 1
    n_err = len(errors)
    name = cfg.actor_rollout_ref.rollout.name
    if name != "vllm":
        errors.append(f"{KEY}={tp} needs actor_rollout_ref.rollout.name=vllm (got {name!r}: Hugging Face generate "
                      "runs one whole model per worker); legal with hf: 1")
    where = "rollout.n_gpus_per_node" if separate_pool else "trainer.n_gpus_per_node"
    if pool.procs_per_node % tp:
        errors.append(f"{KEY}={tp} must divide the {pool.procs_per_node} rollout workers per node ({where}): an "
                      f"engine's ranks all-reduce every layer and stay inside a node; legal values: "
                      f"{divisors(pool.procs_per_node)}")
    return 1 if len(errors) > n_err else tp
