"""Configuration: dataclass schema, Hydra registration, validation (no torch imports)."""

from rlsp.config.schema import RLSPConfig
from rlsp.config.validate import ParallelLayout, validate_config

__all__ = ["RLSPConfig", "ParallelLayout", "validate_config"]
