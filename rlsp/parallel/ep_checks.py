"""Start-up check of expert parallelism against a model's config (the preflight stage; no process group).

`check_ep_support(config, ep)` refuses, naming the value and what is legal, an expert-parallel degree > 1 that
the model cannot take: a dense model (no routed experts), a degree that does not divide the experts of its MoE
layers, or a family whose experts do not compute through transformers' experts registry (the
`use_experts_implementation` decorator), which rlsp.parallel.expert_parallel relies on to dispatch tokens
without patching model code. The same conditions are checked again where the engine applies EP.
"""

from __future__ import annotations

import importlib
from typing import Any

EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # a MoE config's expert count, by family


def expert_count(config: Any) -> int:
    """Routed experts per MoE layer of `config` (its text config for a multimodal wrapper); 0 for a dense model."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in EXPERT_KEYS:
        value = getattr(text, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def uses_experts_registry(model_type: str) -> bool:
    """True when transformers' modeling module of `model_type` holds an experts class decorated with
    `use_experts_implementation` (the decorator gives every such class an `_apply_gate`)."""
    try:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:
        return False
    return any(isinstance(obj, type) and "Experts" in name and hasattr(obj, "_apply_gate")
               for name, obj in vars(module).items())


def check_ep_support(config: Any, ep: int) -> None:
    """Raise ValueError when `ep` experts-parallel ranks cannot split `config`'s MoE layers."""
    if ep == 1:
        return
    model_type = getattr(config, "model_type", "?")
    experts = expert_count(config)
    if experts == 0:
        raise ValueError(f"expert_parallel_size={ep} needs a mixture-of-experts model; {model_type} has no routed "
                         f"experts ({'/'.join(EXPERT_KEYS)} unset); legal value: 1")
    if experts % ep:
        legal = [d for d in range(1, experts + 1) if experts % d == 0]
        raise ValueError(f"expert_parallel_size={ep} does not divide the {experts} experts of each {model_type} MoE "
                         f"layer; legal values: {legal} (that also divide the role's ranks)")
    if not uses_experts_registry(model_type):
        raise ValueError(f"expert_parallel_size={ep}: {model_type}'s experts do not compute through transformers' "
                         "experts registry (use_experts_implementation), which rlsp's expert dispatch plugs into; "
                         "legal value for this family: 1")
