"""verl's "grpo_vectorized" and "rloo_vectorized" estimator names, as aliases of rlsp's grpo and rloo.

verl has a loop implementation ("grpo", "rloo") and a scatter-based one ("..._vectorized") of the same
math. rlsp's grpo and rloo (rlsp/algos/grpo.py, rloo.py) are already computed with scatter operations,
so each alias runs the very same function: identical outputs, the same shared settings read (grpo:
``norm_adv_by_std``; rloo: none), the same guard against settings it does not read.

Where verl's vectorized functions differ from its loop versions, the aliases follow the loop versions
(i.e. rlsp's grpo and rloo): verl's grpo_vectorized computes in float32 with the group variance floored
at eps and, called through verl's trainer, never sees algorithm.norm_adv_by_std_in_grpo (always divides
by the std); verl's rloo_vectorized gives a group of one sample advantage 0 instead of its raw score.
With actor_rollout_ref.rollout.n >= 2 (required for both) the last case does not arise.
"""

from __future__ import annotations

from rlsp.algos import grpo, rloo  # noqa: F401  (registers the targets first)
from rlsp.algos.registry import estimator_uses, get_adv_estimator, reads_groups, register_adv_estimator

# alias -> the registered estimator it runs.
ESTIMATOR_ALIASES: dict[str, str] = {"grpo_vectorized": "grpo", "rloo_vectorized": "rloo"}


def register_alias(alias: str, target: str) -> None:
    """Register ``alias`` to run estimator ``target``, reading exactly the settings (and groups) ``target`` reads."""
    register_adv_estimator(alias, uses=estimator_uses(target), groups=reads_groups(target))(get_adv_estimator(target))


for _alias, _target in ESTIMATOR_ALIASES.items():
    register_alias(_alias, _target)
