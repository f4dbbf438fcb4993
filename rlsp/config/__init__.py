"""Configuration: dataclass schema, Hydra registration, validation (no torch imports)."""

from rlsp.config.layout import ParallelLayout, RoleLayout, World
from rlsp.config.schema import RLSPConfig
from rlsp.config.validate import validate_config

__all__ = ["ParallelLayout", "RLSPConfig", "RoleLayout", "World", "validate_config"]
