"""Registers the schema with Hydra's ConfigStore so YAML values are type-checked against it."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from rlsp.config.schema import RLSPConfig

SCHEMA_NAME = "rlsp_schema"


def register_schema() -> None:
    ConfigStore.instance().store(name=SCHEMA_NAME, node=RLSPConfig)
