"""Key names: every key of a config must be declared by the schema (rlsp.config.schema); an unknown key
is named with the reason when it is a verl key rlsp refuses, else with the nearest legal keys.

Used by `validate_config` (the composed config) and by rlsp.config.compose (the command line's
overrides, screened before Hydra composes them).
"""

from __future__ import annotations

import difflib
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlsp.config.schema import RLSPConfig
from rlsp.config.verl_compat import refusal


def _declared(node: DictConfig, prefix: str = "") -> list[str]:
    keys = []
    for key in node.keys():
        child = node._get_node(key)
        keys.append(f"{prefix}{key}")
        if isinstance(child, DictConfig):
            keys += _declared(child, f"{prefix}{key}.")
    return keys


def schema_keys() -> list[str]:
    """Every key the schema declares (sections included), dotted."""
    return _declared(OmegaConf.structured(RLSPConfig))


def _nearest(key: str, legal: list[str]) -> list[str]:
    """Legal keys close to `key`: by full path, then by the last name component anywhere in the schema."""
    near = difflib.get_close_matches(key, legal, n=3, cutoff=0.6)
    leaf = key.rsplit(".", 1)[-1]
    leaves = difflib.get_close_matches(leaf, sorted({k.rsplit(".", 1)[-1] for k in legal}), n=2, cutoff=0.75)
    near += [k for k in legal if k.rsplit(".", 1)[-1] in leaves and k not in near]
    return near[:4]


def unknown_key_error(key: str, legal: list[str], written: str = "") -> str:
    """The message for a key the schema does not declare: verl's refusal with its reason, or the nearest
    legal keys (`written`: the override as the user typed it, shown beside the key)."""
    near = ", ".join(_nearest(key, legal)) or "see docs/config.md for every key"
    return refusal(key) or f"unknown config key {key!r}{f' ({written})' if written else ''}; nearest legal keys: {near}"


def _unknown_keys(cfg: Any, schema: DictConfig, prefix: str = "") -> list[str]:
    unknown = []
    for key in cfg.keys():
        if key not in schema:
            unknown.append(f"{prefix}{key}")
        elif schema._get_node(key)._metadata.object_type is dict:
            continue  # an open mapping of user-named entries (distillation.teacher_models): its section checks them
        elif isinstance(schema._get_node(key), DictConfig) and isinstance(cfg._get_node(key), DictConfig):
            unknown += _unknown_keys(cfg._get_node(key), schema._get_node(key), f"{prefix}{key}.")
    return unknown


def check_known_keys(cfg: Any, errors: list[str]) -> None:
    """Every key must be declared in the schema, whatever its prefix (`+key` adds keys in Hydra)."""
    if not isinstance(cfg, DictConfig):
        return
    schema = OmegaConf.structured(RLSPConfig)
    legal = _declared(schema)
    errors.extend(unknown_key_error(key, legal) for key in _unknown_keys(cfg, schema))
