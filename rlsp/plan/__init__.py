"""The layout planner: model shape, memory and communication models, enumeration of layouts (no torch)."""

from rlsp.config.plan.memory import HeadShare, MemoryEstimate, MemoryOptions, Workload, plan_memory
from rlsp.config.plan.shape import ModelShape, read_model_shape, shape_from_config

__all__ = ["HeadShare", "MemoryEstimate", "MemoryOptions", "ModelShape", "plan_memory", "read_model_shape",
           "shape_from_config", "Workload"]
