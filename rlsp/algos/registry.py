"""Name -> function registries for advantage estimators and policy losses.

Every advantage estimator shares one signature so the trainer calls them all alike::

    fn(token_level_rewards_BR, response_mask_BR, index, *,
       norm_adv_by_std=True, gamma=1.0, lam=1.0, values_BR=None, eps=1e-6)
        -> (advantages_BR, returns_BR)

``index`` holds one group id per row (samples of one prompt share it). An estimator that does not
use one of the keyword arguments accepts it only at its default value (``None`` for ``values_BR``):
the registration wraps every estimator in that guard (:func:`unused_settings`, which preflight also
runs on the config), so a setting never gets silently dropped.

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

F = TypeVar("F", bound=Callable[..., Any])

_ADV_ESTIMATORS: dict[str, Callable[..., Any]] = {}
_ADV_USES: dict[str, tuple[str, ...]] = {}
_POLICY_LOSSES: dict[str, Callable[..., Any]] = {}

# Defaults of the shared estimator keywords; an estimator that ignores a keyword insists on these.
ESTIMATOR_DEFAULTS: dict[str, Any] = {
    "norm_adv_by_std": True,
    "gamma": 1.0,
    "lam": 1.0,
    "values_BR": None,
}


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


def register_adv_estimator(name: str, uses: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Decorator registering an advantage estimator under ``name``; ``uses`` names the shared
    keywords (keys of :data:`ESTIMATOR_DEFAULTS`) it reads, so callers can pass exactly those."""
    unknown = sorted(set(uses) - set(ESTIMATOR_DEFAULTS))
    if unknown:
        raise ValueError(f"estimator {name!r} declares unknown keywords {unknown}; legal: {sorted(ESTIMATOR_DEFAULTS)}")
    _ADV_USES[name] = tuple(uses)

    def decorator(fn: F) -> F:
        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            for key, value in unused_settings(name, **kwargs).items():
                shown = "a tensor" if ESTIMATOR_DEFAULTS[key] is None else repr(value)
                raise ValueError(f"advantage estimator {name!r} does not use {key}; got {shown}, leave it at its "
                                 f"default {ESTIMATOR_DEFAULTS[key]!r} (estimators using it: {users_of(key)})")
            return fn(*args, **kwargs)

        return _register(_ADV_ESTIMATORS, "advantage estimator", name)(guarded)  # type: ignore[arg-type]

    return decorator


def unused_settings(name: str, **settings: Any) -> dict[str, Any]:
    """The shared keywords in ``settings`` that estimator ``name`` does not read and that differ from
    their default (:data:`ESTIMATOR_DEFAULTS`): the one check that no setting is silently dropped."""
    uses = _ADV_USES[name]
    out = {}
    for key, value in settings.items():
        if key in uses or key not in ESTIMATOR_DEFAULTS:
            continue
        default = ESTIMATOR_DEFAULTS[key]
        if not (value is None if default is None else value == default):
            out[key] = value
    return out


def users_of(key: str) -> list[str]:
    """Sorted names of the estimators that read shared keyword ``key``."""
    return sorted(name for name, uses in _ADV_USES.items() if key in uses)


def estimator_uses(name: str) -> tuple[str, ...]:
    """The shared keywords estimator ``name`` reads (e.g. ("gamma", "lam", "values_BR") for GAE)."""
    _lookup(_ADV_ESTIMATORS, "advantage estimator", name)
    return _ADV_USES[name]


def compute_advantages(name: str, token_level_rewards_BR: Any, response_mask_BR: Any, index: Any,
                       **settings: Any) -> tuple[Any, Any]:
    """Run estimator ``name`` with every shared keyword the caller knows (from the config); one it
    does not read must be at its default (the registration's guard raises otherwise)."""
    return get_adv_estimator(name)(token_level_rewards_BR, response_mask_BR, index, **settings)


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
