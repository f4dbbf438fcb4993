"""Which tensor-parallel degrees a model takes: the heads and the dense MLPs split evenly, and the families
rlsp's tensor parallelism runs (rlsp.parallel.tensor_parallel); read by preflight, the planner and the engine.

A sparse MoE block runs replicated over tp (rlsp.parallel.tp_families.LocalReplicatedMoE), so its expert width
(moe_intermediate_size, or mixtral's / olmoe's / gpt_oss's intermediate_size) need not divide; the dense layers of
a MoE family (glm4_moe's first_k_dense_replace, qwen2/3_moe's mlp_only_layers or decoder_sparse_step) split
intermediate_size like any dense model's.
"""

from __future__ import annotations

import math
from typing import Any

from rlsp.config.layer_kinds import MLA_TYPES, layer_kinds
from rlsp.parallel.tp_families import REPLICATED_MOE_FAMILIES

TP_SIZE_KEY = "tensor_model_parallel_size"
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # a MoE config's expert count, by family


def _experts(config: Any) -> str | None:
    """`key=value` of the config's routed-expert count, or None for a dense model."""
    return next((f"{k}={getattr(config, k)}" for k in EXPERT_KEYS if getattr(config, k, None)), None)


def _has_dense_mlp(config: Any) -> bool:
    """Whether some decoder layer has a dense MLP (split over tp): every layer of a dense model, the layers
    without experts of a MoE family whose sparse blocks run replicated."""
    if not _experts(config) or getattr(config, "model_type", None) not in REPLICATED_MOE_FAMILIES:
        return True
    return any(not kind.mlp.moe for kind in layer_kinds(config.to_dict()))


def tp_split_dims(config: Any) -> dict[str, int]:
    """The sizes tensor parallelism splits evenly, by config key: the q and kv heads, intermediate_size when
    some layer has a dense MLP, and linear_num_key_heads when some layer is a Gated DeltaNet (linear_attention: split
    by key-head groups, rlsp.parallel.tp_linear_attention; its value heads follow, a multiple of the key heads)."""
    keys = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
    dims = {k: getattr(config, k, None) for k in keys}
    if "linear_attention" in (getattr(config, "layer_types", None) or ()):  # Gated DeltaNet: split by key-head groups
        dims["linear_num_key_heads"] = getattr(config, "linear_num_key_heads", None)
    if not all(isinstance(d, int) and d >= 1 for d in dims.values()):
        raise ValueError(
            f"config {type(config).__name__} needs integer {', '.join(dims)} for tensor parallelism (got "
            f"{list(dims.values())})"
        )
    if not _has_dense_mlp(config):
        del dims["intermediate_size"]
    return dims


def legal_tp_sizes(config: Any) -> list[int]:
    """tp sizes that divide every size of `tp_split_dims` (heads, dense intermediate size, linear key heads)."""
    common = math.gcd(*tp_split_dims(config).values())
    return [d for d in range(1, common + 1) if common % d == 0]


def _family_errors(config: Any, tp_size: int) -> str | None:
    """Why the model's family cannot take tp_size > 1 (None: it can)."""
    if getattr(config, "kv_lora_rank", None) and config.model_type not in MLA_TYPES:  # rlsp.parallel.tp_latent
        return (f"{TP_SIZE_KEY}={tp_size}: {config.model_type} has multi-latent attention (kv_lora_rank="
                f"{config.kv_lora_rank}), which rlsp's tensor parallelism splits for {list(MLA_TYPES)} only; legal: 1")
    experts = _experts(config)
    if experts and config.model_type not in REPLICATED_MOE_FAMILIES:
        return (f"{TP_SIZE_KEY}={tp_size}: {config.model_type} has mixture-of-experts layers ({experts}); rlsp's "
                f"tensor parallelism runs them for {list(REPLICATED_MOE_FAMILIES)} only (experts replicated over tp); "
                "legal: 1 (use Ulysses sequence parallelism)")
    return None


def check_tp_support(config: Any, tp_size: int) -> None:
    """Raise ValueError unless `tp_size` splits this model's heads and dense MLPs evenly and its family runs under
    tensor parallelism (multi-latent attention outside the split families, other MoE families: never)."""
    if isinstance(tp_size, int) and tp_size > 1 and (why := _family_errors(config, tp_size)):
        raise ValueError(why)
    legal = legal_tp_sizes(config)
    if isinstance(tp_size, int) and tp_size in legal:
        return
    dims = tp_split_dims(config)
    split = f"{dims['num_attention_heads']} q heads / {dims['num_key_value_heads']} kv heads" + (
        f" / intermediate_size {dims['intermediate_size']}" if "intermediate_size" in dims
        else " (every MLP a MoE block, replicated over tp)") + (
        f" / linear_num_key_heads {dims['linear_num_key_heads']}" if "linear_num_key_heads" in dims else "")
    raise ValueError(
        f"{TP_SIZE_KEY}={tp_size!r} does not divide {split}; legal {TP_SIZE_KEY} for this model: "
        f"{', '.join(map(str, legal))}"
    )


def local_head_counts(config: Any, tp_size: int) -> tuple[int, int]:
    """(q heads, kv heads) of one tp rank: what `build_sp_context` needs under tensor parallelism."""
    check_tp_support(config, tp_size)
    return config.num_attention_heads // tp_size, config.num_key_value_heads // tp_size
