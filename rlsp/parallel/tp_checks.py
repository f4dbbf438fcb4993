"""Which tensor-parallel degrees a model takes: the heads and the MLP split evenly, and the families
rlsp's tensor parallelism runs (rlsp.parallel.tensor_parallel); read by preflight, the planner and the engine."""

from __future__ import annotations

import math
from typing import Any

from rlsp.parallel.tp_families import REPLICATED_MOE_FAMILIES

TP_SIZE_KEY = "tensor_model_parallel_size"
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # a MoE config's expert count, by family



def legal_tp_sizes(config: Any) -> list[int]:
    """tp sizes that divide the q heads, the kv heads and the intermediate size of a decoder config."""
    dims = [getattr(config, k, None) for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size")]
    if not all(isinstance(d, int) and d >= 1 for d in dims):
        raise ValueError(
            f"config {type(config).__name__} needs integer num_attention_heads, num_key_value_heads and "
            f"intermediate_size for tensor parallelism (got {dims})"
        )
    common = math.gcd(*dims)
    return [d for d in range(1, common + 1) if common % d == 0]


def check_tp_support(config: Any, tp_size: int) -> None:
    """Raise ValueError unless `tp_size` splits this model's heads and MLP evenly (multi-latent attention: never)."""
    if isinstance(tp_size, int) and tp_size > 1 and getattr(config, "kv_lora_rank", None):  # latents: not split
        raise ValueError(f"{TP_SIZE_KEY}={tp_size}: {config.model_type} has multi-latent attention (kv_lora_rank="
                         f"{config.kv_lora_rank}), which rlsp's tensor parallelism does not split; legal: 1")
    if isinstance(tp_size, int) and tp_size > 1 and "linear_attention" in (getattr(config, "layer_types", None) or ()):
        raise ValueError(f"{TP_SIZE_KEY}={tp_size}: {config.model_type} has linear_attention (Gated DeltaNet) layers, "
                         "which rlsp's tensor parallelism does not split; legal: 1 (use Ulysses sequence parallelism)")
    experts = next((f"{k}={getattr(config, k)}" for k in EXPERT_KEYS if getattr(config, k, None)), None)
    if isinstance(tp_size, int) and tp_size > 1 and experts and config.model_type not in REPLICATED_MOE_FAMILIES:
        raise ValueError(f"{TP_SIZE_KEY}={tp_size}: {config.model_type} has mixture-of-experts layers ({experts}); "
                         f"rlsp's tensor parallelism runs them for {list(REPLICATED_MOE_FAMILIES)} only (experts "
                         "replicated over tp); legal: 1 (use Ulysses sequence parallelism)")
    legal = legal_tp_sizes(config)
    if isinstance(tp_size, int) and tp_size in legal:
        return
    q, kv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    raise ValueError(
        f"{TP_SIZE_KEY}={tp_size!r} does not divide {q} q heads / {kv} kv heads / intermediate_size {inter}; "
        f"legal {TP_SIZE_KEY} for this model: {', '.join(map(str, legal))}"
    )


def local_head_counts(config: Any, tp_size: int) -> tuple[int, int]:
    """(q heads, kv heads) of one tp rank: what `build_sp_context` needs under tensor parallelism."""
    check_tp_support(config, tp_size)
    return config.num_attention_heads // tp_size, config.num_key_value_heads // tp_size
