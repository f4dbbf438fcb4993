"""Configuration: dataclass schema, Hydra registration, validation (no torch imports)."""

from rlsp.config.layout import MeshLayout, ParallelLayout
from rlsp.config.schema import RLSPConfig
from rlsp.config.validate import validate_config

__all__ = ["MeshLayout", "RLSPConfig", "ParallelLayout", "validate_config"]
