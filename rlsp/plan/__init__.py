"""The layout planner: model shape, memory and communication models, enumeration of layouts (no torch);
its command line is `python -m rlsp.plan` (rlsp/plan/cli.py)."""

from rlsp.config.model_shape import ModelShape, read_model_shape, shape_from_config
from rlsp.plan.memory import HeadShare, MemoryEstimate, MemoryOptions, Workload, plan_memory

__all__ = ["HeadShare", "MemoryEstimate", "MemoryOptions", "ModelShape", "plan_memory", "read_model_shape",
           "shape_from_config", "Workload"]
