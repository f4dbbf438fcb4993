"""Name -> function registries for advantage estimators and policy losses.

Every advantage estimator takes one record (rlsp/algos/adv_inputs.py) so the trainer calls them all
alike::

    fn(inputs: AdvantageInputs) -> (advantages_BR, returns_BR)

``inputs.index`` holds one group id per row (samples of one prompt share it). An estimator declares the
settings of the record it reads (``uses``: keys of :data:`ESTIMATOR_DEFAULTS`) and whether it reads the
groups (``groups``: statistics over the rows of one prompt; a caller that splits the rows must keep every
group whole, rlsp.workers.step_stage); a setting it does not read must be at its default (``None`` for the optional inputs such as ``values_BR``): the registration wraps
every estimator in that guard (:func:`unused_settings`, which preflight also runs on the config), so a
setting never gets silently dropped.

Every policy loss shares::

    fn(logprobs, old_logprobs, advantages, mask, **loss_kwargs) -> (loss_tokens, metrics)

Rollout-correction importance weights (``register_rollout_is``) and rejection criteria
(``register_rollout_rs``) have registries of their own (rlsp/algos/rollout_is.py, rollout_rs.py).

Estimators and losses register themselves from their own module; importing ``rlsp.algos`` imports
all of them, so the registries are full whenever this module is reachable.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from rlsp.algos.adv_inputs import ESTIMATOR_DEFAULTS, AdvantageInputs, is_default

F = TypeVar("F", bound=Callable[..., Any])

_ADV_ESTIMATORS: dict[str, Callable[..., Any]] = {}
_ADV_USES: dict[str, tuple[str, ...]] = {}
_ADV_GROUPS: set[str] = set()
_POLICY_LOSSES: dict[str, Callable[..., Any]] = {}

__all__ = ["ESTIMATOR_DEFAULTS", "AdvantageInputs"]


def _register(table: dict[str, Callable[..., Any]], kind: str, name: str) -> Callable[[F], F]:
    def decorator(fn: F) -> F:
        if name in table and table[name] is not fn:
            raise ValueError(f"{kind} {name!r} is already registered (by {table[name].__qualname__})")
        table[name] = fn
        return fn

    return decorator


def _lookup(table: dict[str, Callable[..., Any]], kind: str, name: str) -> Callable[..., Any]:
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; legal names: {', '.join(sorted(table))}")
    return table[name]


def register_adv_estimator(name: str, uses: tuple[str, ...] = (), groups: bool = False) -> Callable[[F], F]:
    """Decorator registering an advantage estimator ``fn(inputs: AdvantageInputs)`` under ``name``;
    ``uses`` names the settings (keys of :data:`ESTIMATOR_DEFAULTS`) it reads, ``groups`` whether it reads
    ``inputs.index`` (statistics within prompt groups)."""
    unknown = sorted(set(uses) - set(ESTIMATOR_DEFAULTS))
    if unknown:
        raise ValueError(f"estimator {name!r} declares unknown settings {unknown}; legal: {sorted(ESTIMATOR_DEFAULTS)}")
    _ADV_USES[name] = tuple(uses)
    if groups:
        _ADV_GROUPS.add(name)

    def decorator(fn: F) -> F:
        @functools.wraps(fn)
        def guarded(inputs: AdvantageInputs) -> Any:
            if not isinstance(inputs, AdvantageInputs):
                raise TypeError(f"advantage estimator {name!r} takes one AdvantageInputs, got {type(inputs).__name__}")
            for key, value in unused_settings(name, **inputs.settings()).items():
                shown = "a value" if ESTIMATOR_DEFAULTS[key] is None else repr(value)
                raise ValueError(f"advantage estimator {name!r} does not use {key}; got {shown}, leave it at its "
                                 f"default {ESTIMATOR_DEFAULTS[key]!r} (estimators using it: {users_of(key)})")
            return fn(inputs)

        return _register(_ADV_ESTIMATORS, "advantage estimator", name)(guarded)  # type: ignore[arg-type]

    return decorator


def unused_settings(name: str, **settings: Any) -> dict[str, Any]:
    """The settings in ``settings`` that estimator ``name`` does not read and that differ from their
    default (:data:`ESTIMATOR_DEFAULTS`): the one check that no setting is silently dropped."""
    uses = _ADV_USES[name]
    return {key: value for key, value in settings.items()
            if key not in uses and key in ESTIMATOR_DEFAULTS and not is_default(key, value)}


def users_of(key: str) -> list[str]:
    """Sorted names of the estimators that read setting ``key``."""
    return sorted(name for name, uses in _ADV_USES.items() if key in uses)


def estimator_uses(name: str) -> tuple[str, ...]:
    """The settings estimator ``name`` reads (e.g. ("gamma", "lam", "values_BR") for GAE)."""
    _lookup(_ADV_ESTIMATORS, "advantage estimator", name)
    return _ADV_USES[name]


def reads_groups(name: str) -> bool:
    """Whether estimator ``name`` computes statistics within prompt groups (``inputs.index``): rows given to
    it in parts must hold every group whole."""
    _lookup(_ADV_ESTIMATORS, "advantage estimator", name)
    return name in _ADV_GROUPS


def compute_advantages(name: str, inputs: AdvantageInputs) -> tuple[Any, Any]:
    """Run estimator ``name`` on ``inputs``; a setting it does not read must be at its default (the
    registration's guard raises otherwise)."""
    return get_adv_estimator(name)(inputs)


def get_adv_estimator(name: str) -> Callable[..., Any]:
    """The estimator registered as ``name``; ValueError listing the legal names otherwise."""
    return _lookup(_ADV_ESTIMATORS, "advantage estimator", name)


def list_adv_estimators() -> list[str]:
    """Sorted names of all registered advantage estimators."""
    return sorted(_ADV_ESTIMATORS)


def register_policy_loss(name: str) -> Callable[[F], F]:
    """Decorator registering a per-token policy loss under ``name``."""
    return _register(_POLICY_LOSSES, "policy loss", name)


def get_policy_loss(name: str) -> Callable[..., Any]:
    """The policy loss registered as ``name``; ValueError listing the legal names otherwise."""
    return _lookup(_POLICY_LOSSES, "policy loss", name)


def list_policy_losses() -> list[str]:
    """Sorted names of all registered policy losses."""
    return sorted(_POLICY_LOSSES)


_ROLLOUT_IS: dict[str, Callable[..., Any]] = {}
_ROLLOUT_RS: dict[str, Callable[..., Any]] = {}


def register_rollout_is(name: str) -> Callable[[F], F]:
    """Decorator registering an importance-weight level (``algorithm.rollout_correction.rollout_is``)::

        fn(log_ratio_BR, mask_BR) -> (log_weight_BR, log_ratio_for_metrics)
    """
    return _register(_ROLLOUT_IS, "rollout_is level", name)


def get_rollout_is(name: str) -> Callable[..., Any]:
    return _lookup(_ROLLOUT_IS, "rollout_is level", name)


def list_rollout_is() -> list[str]:
    return sorted(_ROLLOUT_IS)


def register_rollout_rs(name: str, fn: Callable[..., Any]) -> None:
    """Register a rejection criterion (``algorithm.rollout_correction.rollout_rs``)::

        fn(log_ratio_BR, mask_BR, lower, upper) -> (keep_BR bool, statistic)
    """
    _register(_ROLLOUT_RS, "rollout_rs option", name)(fn)


def get_rollout_rs(name: str) -> Callable[..., Any]:
    return _lookup(_ROLLOUT_RS, "rollout_rs option", name)


def list_rollout_rs() -> list[str]:
    return sorted(_ROLLOUT_RS)
