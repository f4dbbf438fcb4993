"""Load HF causal LMs for training with Ulysses attention, and check that an architecture supports it.

Supported: decoder-only models whose every layer is full causal softmax attention with standard
(grouped-query) heads, reached through transformers' attention interface, and a plain linear output
layer (tied or not). Gated DeltaNet (linear_attention) layers of Qwen3-Next / Qwen3.5 (`LINEAR_FAMILIES`) run
in rlsp.models.linear_attention (swapped in at load; ring attention and tensor parallelism refuse them). Refused
with a clear message: sliding-window layers, other linear/hybrid attention layers, multi-latent attention outside
the verified families (`MLA_FAMILIES`: deepseek_v2, deepseek_v3, whose value head dim differs from the query/key
one; ring attention runs them with v's own head dim, tensor parallelism refuses them), encoder-decoders, logit scaling (the vocab-chunked logprobs
compute
`hidden @ lm_head.weight.T`, soft-capped by `config.final_logit_softcapping` when set). Sliding-window
layers named by `config.layer_types` and attention soft-capping run in rlsp.models.window_attention
(Gemma 2, Gemma 3, gpt-oss, whose attention sinks run there too); ring attention runs them too for these families (`check_ring_support`). An architecture that passes these checks but
routes some layer around the attention interface is caught at runtime by the layer-count check of
`rlsp.models.lm.TokenLogprobModel`. Qwen3.5 vision-language wrapper checkpoints (`TEXT_WRAPPERS`) train as their text model
(with `vision_tower=True`, `TOWER_OPTIONAL`: with their tower, as below);
Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE (`VISION_FAMILIES`) load with their vision tower (AutoModelForImageTextToText; the text model
through rlsp_ulysses, the tower through its own attention) and train through rlsp.models.vision_lm.

`read_model_config(key, path)` and `tokenizer_problem(key, path)` check a model directory named by a config
key before anything loads it (preflight and rlsp.check): one message naming the key, the path and what
is missing, instead of transformers' traceback (or, for a missing tokenizer, its silently empty one).
"""

from __future__ import annotations

import copy
import json
import logging
import os
from typing import Any

import torch
import transformers
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PretrainedConfig,
    PreTrainedModel,
)

from rlsp.config.model_shape import TEXT_WRAPPERS
from rlsp.models.attention import ULYSSES_ATTN_IMPL, register_ulysses_attention
from rlsp.models.linear_attention import (
    LINEAR_FAMILIES,
    LINEAR_LAYER_TYPE,
    apply_linear_attention,
    has_linear_layers,
)
from rlsp.models.vision_inputs import (
    TOWER_FAMILIES,
    TOWER_OPTIONAL,
    VISION_FAMILIES,
    VISION_TEXT_TYPES,
    attn_implementation_for,
)

log = logging.getLogger(__name__)


# Config attributes whose presence (with a truthy value) means the output or attention is not the
# plain form rlsp computes; value = why.
_UNSUPPORTED_ATTRS = {
    "kv_lora_rank": "multi-latent attention (compressed kv) is verified exact in rlsp_ulysses for deepseek_v2 and "
                    "deepseek_v3 only (tests/distributed/test_deepseek_exact.py)",
    "logit_scale": "scaled output logits are not applied by the vocab-chunked logprobs",
}

# A tokenizer's vocabulary is in one of these files (fast tokenizers, BPE, WordPiece), or in a
# sentencepiece `*.model` / tiktoken `*.tiktoken` file. Without any, transformers 5 builds an empty
# tokenizer (one token) from the model's config instead of failing.
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")
TOKENIZER_SUFFIXES = (".model", ".tiktoken")


def read_model_config(key: str, path: str) -> PretrainedConfig:
    """The config of the Hugging Face model directory `path` (the value of config key `key`); ValueError
    naming the key, the path and what is missing: the directory, config.json, a model_type transformers knows."""
    where = f"{key}={path!r}"
    if not os.path.isdir(path):
        raise ValueError(f"{where} is not a local directory with a Hugging Face model")
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ValueError(f"{where} has no config.json; a Hugging Face model directory holds config.json, the "
                         "weights (*.safetensors) and the tokenizer files")
    try:
        with open(file) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"{where}: its config.json is not a readable JSON object ({exc})") from None
    if not model_type:
        raise ValueError(f"{where}: its config.json has no model_type; legal: a model type transformers "
                         f"{transformers.__version__} knows (e.g. llama, qwen2, qwen3, mistral)")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"{where}: its config.json has model_type={model_type!r}, which transformers "
                         f"{transformers.__version__} does not know (rlsp loads models without remote code); legal: "
                         "a model type transformers knows (e.g. llama, qwen2, qwen3, mistral)")
    try:
        return text_model_config(AutoConfig.from_pretrained(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: its config.json is unreadable ({exc})") from None


def text_model_config(config: PretrainedConfig) -> PretrainedConfig:
    """The text model's config of a `TEXT_WRAPPERS` checkpoint (what AutoModelForCausalLM builds) or of a
    `VISION_FAMILIES` one (its text model runs rlsp_ulysses; rlsp.models.vision_lm), else `config`."""
    wrapped = getattr(config, "model_type", None) in (*TEXT_WRAPPERS, *VISION_FAMILIES)
    return config.text_config if wrapped else config


def tokenizer_problem(key: str, path: str) -> str | None:
    """Why the directory `path` (the value of config key `key`) holds no tokenizer, or None when it has one."""
    names = os.listdir(path) if os.path.isdir(path) else []
    if any(n in TOKENIZER_FILES or n.endswith(TOKENIZER_SUFFIXES) for n in names):
        return None
    return (f"{key}={path!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)} or a "
            f"{' / '.join('*' + s for s in TOKENIZER_SUFFIXES)} file is in it; transformers would build an empty "
            "one); copy the tokenizer files of the model it was trained from into it")


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
    if has_linear_layers(config):
        what = " and ".join(filter(None, [what, f"{LINEAR_LAYER_TYPE} (Gated DeltaNet) layers"]))
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


def build_causal_lm_from_config(
    config: PretrainedConfig, *, dtype: torch.dtype = torch.float32, attn_implementation: str = ULYSSES_ATTN_IMPL,
    vision_tower: bool = False,
) -> PreTrainedModel:
    """Random-init causal LM from a config with the given attention implementation (tests, tiny models);
    `vision_tower`: a Qwen3.5 wrapper config (TOWER_OPTIONAL) builds its ForConditionalGeneration class.

    The config is copied: transformers records the attention implementation on the config object,
    and a model built later from the same object must not change this one's.
    """
    config = copy.deepcopy(config)
    _prepare(config, attn_implementation)
    auto = _auto_class(config, vision_tower)
    model = auto.from_config(config, attn_implementation=attn_implementation_for(config, attn_implementation), dtype=dtype)
    return _finish(model, attn_implementation)


def load_causal_lm(
    path: str, *, dtype: torch.dtype = torch.float32, attn_implementation: str = ULYSSES_ATTN_IMPL,
    vision_tower: bool = False, **kwargs: Any
) -> PreTrainedModel:
    """Load a causal LM from a local path; registers rlsp_ulysses first and checks the architecture.
    `vision_tower`: a Qwen3.5 wrapper checkpoint (TOWER_OPTIONAL) loads with its tower (images) instead of as its
    text model; the families of VISION_FAMILIES always load with theirs."""
    config = AutoConfig.from_pretrained(path)
    _prepare(config, attn_implementation)
    auto = _auto_class(config, vision_tower)
    if auto is AutoModelForCausalLM:
        _log_text_only(config, path)
    model = auto.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation_for(config, attn_implementation),
                                 **kwargs)
    return _finish(model, attn_implementation)


def _auto_class(config: PretrainedConfig, vision_tower: bool) -> type:
    """AutoModelForImageTextToText for a model loaded with its vision tower, else AutoModelForCausalLM."""
    if vision_tower and config.model_type not in TOWER_FAMILIES:
        raise ValueError(f"vision_tower=True: {config.model_type} has no vision tower rlsp trains; legal: "
                         f"{list(TOWER_FAMILIES)}")
    with_tower = config.model_type in VISION_FAMILIES or (vision_tower and config.model_type in TOWER_OPTIONAL)
    return AutoModelForImageTextToText if with_tower else AutoModelForCausalLM


def load_backbone(
    path: str, *, dtype: torch.dtype = torch.float32, attn_implementation: str = ULYSSES_ATTN_IMPL
) -> PreTrainedModel:
    """Load only the decoder (HF base model, no output layer) of a causal-LM checkpoint: a critic's backbone."""
    config = AutoConfig.from_pretrained(path)
    _prepare(config, attn_implementation)
    if config.model_type in VISION_FAMILIES:
        raise ValueError(f"{path}: a {config.model_type} (vision-language) model as a critic or reward backbone is not "
                         "supported; rlsp trains vision-language models as the policy only")
    if config.model_type in TEXT_WRAPPERS:  # AutoModel would build the vision-language model: the text LM's decoder
        _log_text_only(config, path)
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
        return _finish(lm.model, attn_implementation)
    model = AutoModel.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    return _finish(model, attn_implementation)


def _log_text_only(config: PretrainedConfig, path: str) -> None:
    if config.model_type in TEXT_WRAPPERS:
        log.info("%s: a %s (vision-language) checkpoint: rlsp trains its text model only; the vision tower (model.visual.*) "
                 "is not loaded, and the HF export (actor_hf) is the text causal LM alone (model_type %s, model.* names)",
                 path, config.model_type, TEXT_WRAPPERS[config.model_type])


def _prepare(config: PretrainedConfig, attn_implementation: str) -> None:
    if attn_implementation == ULYSSES_ATTN_IMPL:
        register_ulysses_attention()
        check_sp_support(config, 1)


def _finish(model: PreTrainedModel, attn_implementation: str) -> PreTrainedModel:
    """The model rlsp trains: Gated DeltaNet layers swapped for their packed, Ulysses-aware form (same parameters)."""
    if attn_implementation == ULYSSES_ATTN_IMPL:
        apply_linear_attention(model)
    return model
