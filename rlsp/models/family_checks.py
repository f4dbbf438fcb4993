"""What rlsp runs of a model family, read from its config alone (no weights): the text model's config of a wrapper
checkpoint, the head counts, the layer types and attention forms rlsp_ulysses computes exactly, and the degrees
(Ulysses, ring, tensor parallelism) a family allows. Each refusal is a ValueError naming the model type, the config
attribute and what would work; rlsp.models.loading runs `check_sp_support` before it builds a model, and the
preflight checks run them all before any worker starts.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from rlsp.config.model_shape import TEXT_WRAPPERS
from rlsp.models.attention import ULYSSES_ATTN_IMPL
from rlsp.models.linear_attention import LINEAR_FAMILIES, LINEAR_LAYER_TYPE, has_linear_layers
from rlsp.models.vision_inputs import VISION_FAMILIES, VISION_TEXT_TYPES

# Config attributes whose presence (with a truthy value) means the output or attention is not the
# plain form rlsp computes; value = why.
_UNSUPPORTED_ATTRS = {
    "kv_lora_rank": "multi-latent attention (compressed kv) is verified exact in rlsp_ulysses for deepseek_v2 and "
                    "deepseek_v3 only (tests/distributed/test_deepseek_exact.py)",
    "logit_scale": "scaled output logits are not applied by the vocab-chunked logprobs",
}


def text_model_config(config: PretrainedConfig) -> PretrainedConfig:
    """The text model's config of a `TEXT_WRAPPERS` checkpoint (what AutoModelForCausalLM builds) or of a
    `VISION_FAMILIES` one (its text model runs rlsp_ulysses; rlsp.models.vision_lm), else `config`."""
    wrapped = getattr(config, "model_type", None) in (*TEXT_WRAPPERS, *VISION_FAMILIES)
    return config.text_config if wrapped else config


def num_heads(config: PretrainedConfig) -> tuple[int, int]:
    """(num query heads, num kv heads) of a decoder config; raises if they are missing or inconsistent."""
    q = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None)
    if not isinstance(q, int) or q < 1:
        raise ValueError(f"config {type(config).__name__} has num_attention_heads={q!r}; expected an integer >= 1")
    if not isinstance(kv, int) or kv < 1:
        raise ValueError(
            f"config {type(config).__name__} has num_key_value_heads={kv!r}; rlsp needs an explicit "
            "integer >= 1 (set it equal to num_attention_heads for multi-head attention)"
        )
    if q % kv != 0:
        raise ValueError(f"num_attention_heads={q} is not a multiple of num_key_value_heads={kv}")
    return q, kv


# Layer types rlsp_ulysses runs (rlsp.models.window_attention for the windowed ones), and the families whose
# sliding-window layers are verified exact against transformers' own attention (tests/unit/test_window_attention.py,
# tests/unit/test_gpt_oss_attention.py, tests/distributed/test_gemma_exact.py); other families' windowed layers stay
# refused until tested.
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
# Multi-latent attention families verified exact under Ulysses (their attention hands rlsp_ulysses q/k of one head
# dim and v of another; tests/unit/test_deepseek_mla.py, tests/distributed/test_deepseek_exact.py).
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")
WINDOWED_FAMILIES = ("gemma2", "gemma3_text", "gpt_oss")
# Families whose attention adds a learned sink logit per q head to the softmax's denominator (the `s_aux` kwarg; no
# config attribute says so): rlsp.models.window_attention applies it (tests/unit/test_gpt_oss_attention.py).
SINK_FAMILIES = ("gpt_oss",)


def _check_layers(config: PretrainedConfig) -> None:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        linear_ok = config.model_type in LINEAR_FAMILIES  # Gated DeltaNet: rlsp.models.linear_attention
        other = sorted({t for t in layer_types if t not in SUPPORTED_LAYER_TYPES
                        and not (t == LINEAR_LAYER_TYPE and linear_ok)})
        if other:
            raise ValueError(
                f"{config.model_type}: layer types {other} are not supported by {ULYSSES_ATTN_IMPL} (supported: "
                f"{list(SUPPORTED_LAYER_TYPES)}, and {LINEAR_LAYER_TYPE!r} for {list(LINEAR_FAMILIES)}); other linear/hybrid "
                "attention layers cannot be sequence-parallelised this way"
            )
        if "sliding_attention" in layer_types and config.model_type not in WINDOWED_FAMILIES:
            raise ValueError(
                f"{config.model_type}: sliding_attention layers (sliding_window={config.sliding_window}) are verified "
                f"exact in {ULYSSES_ATTN_IMPL} for {list(WINDOWED_FAMILIES)} only; disable the window "
                "(use_sliding_window=False) or pick a verified family"
            )
        return  # config.layer_types says which layers slide; each passes its window to the attention function
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        raise ValueError(
            f"{config.model_type}: sliding_window={window} is enabled without config.layer_types saying which "
            f"layers slide; {ULYSSES_ATTN_IMPL} supports it per layer only (set sliding_window=None or "
            "use_sliding_window=False)"
        )


def windowed_attention(config: PretrainedConfig) -> str | None:
    """What makes this model's attention more than plain causal softmax (sliding windows, soft-capping, sinks), else
    None."""
    parts = []
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        parts.append(f"sliding-window layers (sliding_window={config.sliding_window})")
    if getattr(config, "attn_logit_softcapping", None):
        parts.append(f"attention soft-capping (attn_logit_softcapping={config.attn_logit_softcapping})")
    if config.model_type in SINK_FAMILIES:
        parts.append("attention sinks (a learned logit per q head in the softmax's denominator)")
    return " and ".join(parts) or None


def multi_latent_attention(config: PretrainedConfig) -> str | None:
    """'multi-latent attention (...head dims...)' for a config with `kv_lora_rank` (DeepSeek-V2/V3, Kimi-K2,
    Moonlight), else None."""
    if not getattr(config, "kv_lora_rank", None):
        return None
    qk = (getattr(config, "qk_nope_head_dim", 0) or 0) + (getattr(config, "qk_rope_head_dim", 0) or 0)
    v = getattr(config, "v_head_dim", None)
    relation = "!=" if v != qk else "="
    return f"multi-latent attention (kv_lora_rank={config.kv_lora_rank}, v_head_dim={v} {relation} qk head dim {qk})"


def check_ring_support(config: PretrainedConfig, ring_size: int) -> None:
    """Raise ValueError if ring attention (ring_size > 1) is asked for a model whose layers it cannot run exactly."""
    config = text_model_config(config)
    # multi-latent attention (deepseek_v2/v3) runs: ring attention carries v's own head dim (rlsp.parallel.ring;
    # tests/distributed/test_ring_mla_exact.py)
    if ring_size > 1 and has_linear_layers(config):
        raise ValueError(f"ring_sequence_parallel_size={ring_size}: {config.model_type} has {LINEAR_LAYER_TYPE} "
                         "(Gated DeltaNet) layers, which ring attention does not run; legal: 1 (Ulysses alone runs "
                         "them exactly)")
    # ring attention applies sliding windows, soft-capping and sinks (rlsp.parallel.ring; tests/unit/test_ring_window.py,
    # tests/distributed/test_ring_window_exact.py) of the verified families only
    what = windowed_attention(config)
    if ring_size > 1 and what and config.model_type not in WINDOWED_FAMILIES:
        raise ValueError(f"ring_sequence_parallel_size={ring_size}: {config.model_type} has {what}, which ring "
                         f"attention runs verified for {list(WINDOWED_FAMILIES)} only; legal: 1 (or a verified family)")


def check_tp_windowed(config: PretrainedConfig, tp_size: int) -> None:
    """Raise ValueError for tensor parallelism (tp_size > 1) on a windowed or soft-capped model: verified exact for
    WINDOWED_FAMILIES only (tests/distributed/test_tp_window_exact.py; gpt-oss's experts replicated over tp)."""
    if tp_size > 1 and getattr(config, "model_type", None) in (*VISION_FAMILIES, *VISION_TEXT_TYPES):
        raise ValueError(f"tensor_model_parallel_size={tp_size}: {config.model_type} is a vision-language model, which "
                         "rlsp's tensor parallelism does not run; legal: 1 (use Ulysses / ring sequence parallelism)")
    config = text_model_config(config)
    what = "" if config.model_type in WINDOWED_FAMILIES else windowed_attention(config)
    if getattr(config, "final_logit_softcapping", None) and config.model_type not in WINDOWED_FAMILIES:
        what = " and ".join(filter(None, [what, f"final_logit_softcapping={config.final_logit_softcapping}"]))
    if tp_size > 1 and what:
        raise ValueError(f"tensor_model_parallel_size={tp_size}: {config.model_type} has {what}; rlsp's tensor "
                         "parallelism is not verified exact for it; legal: 1 (use Ulysses sequence parallelism)")


def check_sp_support(config: PretrainedConfig, sp_size: int) -> None:
    """Raise ValueError if this model cannot be trained with Ulysses attention at `sp_size`.

    Every sp >= 1 is accepted for head counts (uneven head splits are supported); when sp exceeds
    the number of query heads some ranks hold no heads inside attention, which is legal but idle.
    """
    if not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(f"sp_size={sp_size!r}; it must be an integer >= 1")
    config = text_model_config(config)  # qwen3_5 / qwen3_5_moe: their text model, trained text-only
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{config.model_type}: encoder-decoder models are not supported; use a decoder-only LM")
    if hasattr(config, "text_config") and not hasattr(config, "num_attention_heads"):
        raise ValueError(
            f"{config.model_type}: multimodal wrapper config; rlsp trains decoder-only text models and the "
            f"vision-language families {list(VISION_FAMILIES)} (pass the text model config/checkpoint; the text model "
            f"of {list(TEXT_WRAPPERS)} checkpoints is trained)"
        )
    num_heads(config)
    for attr, why in _UNSUPPORTED_ATTRS.items():
        if getattr(config, attr, None) and not (attr == "kv_lora_rank" and config.model_type in MLA_FAMILIES):
            raise ValueError(f"{config.model_type}: {attr}={getattr(config, attr)!r}: {why}")
    _check_layers(config)
