"""Which actor keys each policy loss reads, the start-up check that no other is set, and the keyword
arguments the actor passes a loss. No torch import here.

A loss (rlsp/algos, registered by name) receives exactly the keys :data:`POLICY_LOSS_KEYS` lists for it, as
keyword arguments named by the key's last component (``clip_ratio_low``, ``tau_pos``, ...). Every other key
of :data:`POLICY_LOSS_KEY_DEFAULTS` must stay at its default for that loss: never silently ignored. The exception,
:data:`VERL_IGNORED_KEYS` (``clip_ratio_c``), is ignored by verl's losses that do not read it too: accepted
there, and named in the start-up note of rlsp.config.verl_compat.VERL_NOTES.
``clip_ratio`` is the fallback of ``clip_ratio_low`` / ``clip_ratio_high`` (None = clip_ratio), so it counts
as read by every loss that reads either.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlsp.config.schema_policy_loss import PolicyLossConfig

# Actor keys (relative to actor_rollout_ref.actor) each registered policy loss reads; a unit test keeps this
# table and the loss registry in step. A new loss adds one line here.
POLICY_LOSS_KEYS: dict[str, tuple[str, ...]] = {
    "vanilla": ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c"),
    "cispo": ("clip_ratio_low", "clip_ratio_high"),
    "gpg": (),
    "clip_cov": ("clip_ratio_low", "clip_ratio_high", "policy_loss.clip_cov_ratio", "policy_loss.clip_cov_lb", "policy_loss.clip_cov_ub"),
    "kl_cov": ("policy_loss.kl_cov_ratio", "policy_loss.ppo_kl_coef"),
    "dppo_tv": ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c"),
    "dppo_kl": ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c"),
    "bypass_mode": ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c"),  # + algorithm.rollout_correction.* (validate_bypass.py)
    "gspo": ("clip_ratio_low", "clip_ratio_high"),
    "geo_mean": ("clip_ratio_low", "clip_ratio_high"),
    "sapo": ("policy_loss.tau_pos", "policy_loss.tau_neg"),
}

# Every key a policy loss may read, with its schema default (the policy_loss.* ones from the dataclass).
POLICY_LOSS_KEY_DEFAULTS: dict[str, Any] = {
    "clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None, "clip_ratio_c": 3.0,
    **{f"policy_loss.{f.name}": f.default for f in dataclasses.fields(PolicyLossConfig) if f.name != "loss_mode"},
}
CLIP_FALLBACK = {"clip_ratio_low", "clip_ratio_high"}  # None in the config = clip_ratio
# Actor keys verl hands every policy loss (its ActorConfig) that verl's losses not reading them ignore: set off their
# default with such a loss they change nothing in verl either, so rlsp accepts them with the note VERL_NOTES prints
# (rlsp.config.verl_compat) instead of refusing them. verl's GSPO example sets clip_ratio_c=10.0.
VERL_IGNORED_KEYS = ("clip_ratio_c",)
POSITIVE_KEYS = ("policy_loss.tau_pos", "policy_loss.tau_neg")  # sapo's gate temperatures divide (4 / tau)


def reads(name: str, key: str) -> bool:
    """Whether policy loss ``name`` reads actor key ``key`` (clip_ratio through its low/high fallbacks)."""
    keys = POLICY_LOSS_KEYS.get(name, ())
    return key in keys or (key == "clip_ratio" and bool(CLIP_FALLBACK & set(keys)))


def policy_loss_users(key: str) -> list[str]:
    """Sorted names of the policy losses that read actor key ``key``."""
    return sorted(name for name in POLICY_LOSS_KEYS if reads(name, key))


def _select(actor: Any, key: str) -> Any:
    node = actor
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _at_default(key: str, value: Any) -> bool:
    default = POLICY_LOSS_KEY_DEFAULTS[key]
    # clip_ratio_low/high set to clip_ratio's default resolve to what leaving them unset gives.
    return value == default or (key in CLIP_FALLBACK and value == POLICY_LOSS_KEY_DEFAULTS["clip_ratio"])


def check_policy_loss_keys(actor: Any, errors: list[str]) -> None:
    """Name every key off its default that the chosen loss (actor.policy_loss.loss_mode) does not read,
    with the losses that do, and every out-of-range temperature. A loss missing from POLICY_LOSS_KEYS is left
    to preflight's name check."""
    for key in POSITIVE_KEYS:
        if not _select(actor, key) > 0:
            errors.append(f"actor_rollout_ref.actor.{key}={_select(actor, key)} must be > 0 (sapo's gate "
                          "temperature)")
    name = actor.policy_loss.loss_mode
    if name not in POLICY_LOSS_KEYS:
        return
    for key, default in POLICY_LOSS_KEY_DEFAULTS.items():
        value = _select(actor, key)
        if not reads(name, key) and not _at_default(key, value) and key not in VERL_IGNORED_KEYS:
            errors.append(f"actor_rollout_ref.actor.{key}={value} has no effect with actor_rollout_ref.actor."
                          f"policy_loss.loss_mode={name!r}; leave it at {default} or pick a policy loss that uses "
                          f"it: {policy_loss_users(key)}")


def policy_loss_kwargs(actor: Any) -> dict[str, Any]:
    """The keyword arguments of the chosen loss: exactly its POLICY_LOSS_KEYS, named by their last component,
    clip_ratio_low/high resolved against clip_ratio."""
    name = actor.policy_loss.loss_mode
    if name not in POLICY_LOSS_KEYS:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.loss_mode={name!r} declares no keys; known losses: "
                         f"{sorted(POLICY_LOSS_KEYS)}")
    kwargs = {}
    for key in POLICY_LOSS_KEYS[name]:
        value = _select(actor, key)
        if key in CLIP_FALLBACK and value is None:
            value = actor.clip_ratio
        kwargs[key.rpartition(".")[2]] = value
    return kwargs
