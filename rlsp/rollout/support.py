"""Can the chosen rollout engine serve this model on this device? Checked before any worker has the run's config.

vLLM fails on such models only at the first `generate`, deep inside a worker (e.g. "Unsupported CPU
attention configuration: head_dim=16"); this check names the reason and the alternative up front.
With rollout tensor parallelism it also applies vLLM's split rules (heads and MLP width) to the model.
It reads only the model's HF config and never imports vllm.
"""

from __future__ import annotations

from typing import Any

# Head sizes vLLM's CPU attention backend has kernels for (defined once, next to the tiny-model factory
# that must respect them).
from rlsp.config.choices import VLLM_CPU_HEAD_DIMS
from rlsp.utils.divisors import divisors

ALTERNATIVE = "actor_rollout_ref.rollout.name=hf"


def model_head_dim(hf_config: Any) -> int | None:
    """The attention head size: `head_dim` when the config sets it, else hidden_size / num_attention_heads."""
    head_dim = getattr(hf_config, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0:
        return head_dim
    hidden = getattr(hf_config, "hidden_size", None)
    heads = getattr(hf_config, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def check_rollout_tp(hf_config: Any, tp: int) -> str | None:
    """Why vLLM cannot split this model over `tp` ranks (its rules for q/kv heads and the MLP), else None."""
    if tp == 1:
        return None
    key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    q = getattr(hf_config, "num_attention_heads", None)
    kv = getattr(hf_config, "num_key_value_heads", None) or q
    mlp = getattr(hf_config, "intermediate_size", None)
    if isinstance(q, int) and q % tp:
        return f"{key}={tp} must divide the model's {q} attention heads; legal values: {divisors(q)}"
    if isinstance(kv, int) and (kv % tp if kv >= tp else tp % kv):
        return (f"{key}={tp}: vLLM splits {kv} kv heads over tp ranks (tp <= kv heads: tp must divide them) or "
                f"replicates them (tp > kv heads: they must divide tp); legal values: "
                f"{[t for t in divisors(q) if (kv % t == 0 if kv >= t else t % kv == 0)]}")
    if isinstance(mlp, int) and mlp % tp:
        return f"{key}={tp} must divide the model's MLP width intermediate_size={mlp}; legal values: {divisors(mlp)}"
    return None




def check_rollout_support(hf_config: Any, rollout_name: str, device_type: str, tp: int = 1) -> str | None:
    """An error message when rollout engine `rollout_name` cannot serve the model on `device_type` at tensor
    parallelism `tp`, else None."""
    if rollout_name == "vllm" and (tp_error := check_rollout_tp(hf_config, tp)):
        return tp_error
    if rollout_name != "vllm" or device_type != "cpu":
        return None
    head_dim = model_head_dim(hf_config)
    if head_dim is not None and head_dim not in VLLM_CPU_HEAD_DIMS:
        return (
            f"actor_rollout_ref.rollout.name=vllm cannot serve this model on cpu: vLLM's CPU attention has no "
            f"kernel for head_dim={head_dim} (supported head sizes: {list(VLLM_CPU_HEAD_DIMS)}); use {ALTERNATIVE} "
            "(Hugging Face generate) or a model with a supported head size"
        )
    return None
