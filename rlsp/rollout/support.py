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




VLLM_CPU_MOE_ALIGNMENT = 32  # vLLM 0.32's CPU MoE experts (CPUUnquantizedExperts.output_alignment)
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def check_cpu_moe_width(hf_config: Any, tp: int = 1) -> str | None:
    """Why vLLM's CPU MoE experts cannot take synced weights for this model, else None. vLLM 0.32 pads an expert
    width that is not a multiple of 32 (per tp rank) and its reload_weights then fails to copy the synced experts into
    the padded ones (measured on a tiny qwen3_moe, moe_intermediate_size=40: "The size of tensor a (128) must match
    the size of tensor b (80)"). Widths that are multiples take the sync exactly (tests/e2e/test_moe_vllm_sync.py)."""
    if not any(isinstance(getattr(hf_config, k, None), int) and getattr(hf_config, k) > 1 for k in EXPERT_COUNT_KEYS):
        return None
    key = "moe_intermediate_size" if isinstance(getattr(hf_config, "moe_intermediate_size", None), int) \
        else "intermediate_size"
    width = getattr(hf_config, key, None)
    if not isinstance(width, int) or (width // tp) % VLLM_CPU_MOE_ALIGNMENT == 0:
        return None
    return (f"actor_rollout_ref.rollout.name=vllm cannot serve this {getattr(hf_config, 'model_type', '?')} model on "
            f"cpu: its experts' width {key}={width} ({width // tp} per rollout tp rank) is not a multiple of "
            f"{VLLM_CPU_MOE_ALIGNMENT}, so vLLM's CPU MoE kernel pads it and its in-place weight sync then fails on the "
            f"padded experts; use {ALTERNATIVE} (Hugging Face generate) or a model whose {key} per rank is a multiple "
            f"of {VLLM_CPU_MOE_ALIGNMENT}")


def check_rollout_support(hf_config: Any, rollout_name: str, device_type: str, tp: int = 1) -> str | None:
    """An error message when rollout engine `rollout_name` cannot serve the model on `device_type` at tensor
    parallelism `tp`, else None."""
    if rollout_name == "vllm" and (tp_error := check_rollout_tp(hf_config, tp)):
        return tp_error
    if rollout_name != "vllm" or device_type != "cpu":
        return None
    if getattr(hf_config, "model_type", None) == "gpt_oss":
        # vLLM 0.32 (CPU) serves gpt_oss at load (sinks in its CPU attention, swigluoai in its CPU MoE: prompt
        # logprobs equal transformers' eager forward), but after its reload_weights a sinks-only change left a logprob
        # gap of 0.11 and an experts-only change one of 3.6-5.0 (tiny model, 0.05 perturbations; other weights: 2e-5)
        return ("actor_rollout_ref.rollout.name=vllm cannot serve gpt_oss on cpu: vLLM's in-place weight sync "
                "(reload_weights) does not update its attention sinks nor its CPU MoE experts correctly, so rollouts "
                f"would sample from other weights than the trained ones; use {ALTERNATIVE} (Hugging Face generate "
                "with eager attention)")
    if getattr(hf_config, "kv_lora_rank", None):
        # vLLM 0.32's CPU MLA backend (v1/attention/backends/mla/cpu_mla.py: decode kernel for a latent of
        # kv_lora_rank + qk_rope_head_dim = 576 only) loads a tiny deepseek_v3 of that latent, but its prompt
        # logprobs differed from transformers' by 1.4 (dense layers) to 2.0 (MoE)
        return (f"actor_rollout_ref.rollout.name=vllm cannot serve {getattr(hf_config, 'model_type', '?')} on cpu: "
                f"its multi-latent attention (kv_lora_rank={hf_config.kv_lora_rank}) does not match transformers' on "
                f"vLLM's CPU MLA backend (measured on a tiny deepseek_v3); use {ALTERNATIVE} (Hugging Face generate)")
    if "linear_attention" in (getattr(hf_config, "layer_types", None) or ()):
        # vLLM 0.32 (CPU), tried on tiny models: qwen3_next's hybrid state cache ('align' mode) asserts chunked
        # prefill, which rlsp's CPU engine turns off (seeded sampling crashes with it, rlsp.rollout.vllm_engine);
        # qwen3_5's model module imports qwen2_vl's image processor, i.e. torchvision, which this wheel set lacks
        return (f"actor_rollout_ref.rollout.name=vllm cannot serve {getattr(hf_config, 'model_type', '?')} on cpu: "
                "its linear_attention (Gated DeltaNet) layers need vLLM's chunked prefill, which rlsp's CPU engine "
                f"disables; use {ALTERNATIVE} (Hugging Face generate, which keeps their recurrent state while decoding)")
    if moe_error := check_cpu_moe_width(hf_config, tp):
        return moe_error
    head_dim = model_head_dim(hf_config)
    if head_dim is not None and head_dim not in VLLM_CPU_HEAD_DIMS:
        return (
            f"actor_rollout_ref.rollout.name=vllm cannot serve this model on cpu: vLLM's CPU attention has no "
            f"kernel for head_dim={head_dim} (supported head sizes: {list(VLLM_CPU_HEAD_DIMS)}); use {ALTERNATIVE} "
            "(Hugging Face generate) or a model with a supported head size"
        )
    return None


def rollout_ep_errors(hf_config: Any, rollout: Any, device_type: str, tp: int) -> list[str]:
    """Why `actor_rollout_ref.rollout.expert_parallel_size` cannot run: legal are 1 and the engine's tensor-parallel
    degree `tp` (vLLM's enable_expert_parallel places whole experts on the engine's ranks, ep = tp x dp and dp is 1),
    with vllm, on a mixture-of-experts model, on GPU; [] when it can."""
    key, ep = "actor_rollout_ref.rollout.expert_parallel_size", rollout.expert_parallel_size
    if ep == 1:
        return []
    if ep != tp:
        return [f"{key}={ep}: vLLM's expert parallelism spans the engine's tensor-parallel ranks (ep = tp x dp, dp is 1 "
                f"in rlsp); legal values: [1, {tp}] (actor_rollout_ref.rollout.tensor_model_parallel_size={tp})"]
    if rollout.name != "vllm":
        return [f"{key}={ep} is vLLM's enable_expert_parallel; actor_rollout_ref.rollout.name={rollout.name!r}; set "
                "name=vllm or expert_parallel_size=1"]
    if not any(getattr(hf_config, a, None) for a in ("num_experts", "num_local_experts", "n_routed_experts")):
        return [f"{key}={ep} needs a mixture-of-experts model; model_type={getattr(hf_config, 'model_type', None)!r} "
                "has no experts; legal: 1"]
    if device_type == "cpu":
        return [f"{key}={ep}: vLLM 0.32's CPU backend ends in a segmentation fault generating with "
                "enable_expert_parallel; on cpu legal: 1 (tensor parallelism alone splits each expert)"]
    return []
