"""Load HF causal LMs for training with Ulysses attention, and check that an architecture supports it.

Supported: decoder-only models whose every layer is full causal softmax attention with standard
(grouped-query) heads, reached through transformers' attention interface, and a plain linear output
layer (tied or not). Gated DeltaNet (linear_attention) layers of Qwen3-Next / Qwen3.5 (`LINEAR_FAMILIES`) run
in rlsp.models.linear_attention (swapped in at load; ring refuses them, tp splits their key-head groups). Refused
with a clear message: sliding-window layers, other linear/hybrid attention layers, multi-latent attention outside
the verified families (`MLA_FAMILIES`: deepseek_v2, deepseek_v3, whose value head dim differs from the query/key
one; ring attention runs them with v's own head dim, tensor parallelism splits their heads: rlsp.parallel.tp_latent),
encoder-decoders, logit scaling (the vocab-chunked logprobs compute `hidden @ lm_head.weight.T`, soft-capped by
`config.final_logit_softcapping` when set). Sliding-window
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
from rlsp.models.family_checks import check_sp_support, text_model_config
from rlsp.models.linear_attention import apply_linear_attention
from rlsp.models.vision_inputs import (
    TOWER_FAMILIES,
    TOWER_OPTIONAL,
    VISION_FAMILIES,
    attn_implementation_for,
)

log = logging.getLogger(__name__)


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


def tokenizer_problem(key: str, path: str) -> str | None:
    """Why the directory `path` (the value of config key `key`) holds no tokenizer, or None when it has one."""
    names = os.listdir(path) if os.path.isdir(path) else []
    if any(n in TOKENIZER_FILES or n.endswith(TOKENIZER_SUFFIXES) for n in names):
        return None
    return (f"{key}={path!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)} or a "
            f"{' / '.join('*' + s for s in TOKENIZER_SUFFIXES)} file is in it; transformers would build an empty "
            "one); copy the tokenizer files of the model it was trained from into it")


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
    path: str, *, dtype: torch.dtype = torch.float32, attn_implementation: str = ULYSSES_ATTN_IMPL,
    vision_tower: bool = False,
) -> PreTrainedModel:
    """Load only the decoder (HF base model, no output layer) of a causal-LM checkpoint: a critic's backbone. A
    vision-language checkpoint (VISION_FAMILIES; a TOWER_OPTIONAL one with `vision_tower`) gives its base model with
    the tower (`visual` + `language_model`: rlsp.models.value.VisionValueModel)."""
    config = AutoConfig.from_pretrained(path)
    _prepare(config, attn_implementation)
    if _auto_class(config, vision_tower) is AutoModelForImageTextToText:
        vl = AutoModelForImageTextToText.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation_for(config, attn_implementation))
        return _finish(vl.model, attn_implementation)
    if config.model_type in TEXT_WRAPPERS:  # AutoModel would build the vision-language model: the text LM's decoder
        _log_text_only(config, path)
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
        return _finish(lm.model, attn_implementation)
    model = AutoModel.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    return _finish(model, attn_implementation)


def _log_text_only(config: PretrainedConfig, path: str) -> None:
    if config.model_type in TEXT_WRAPPERS:
        log.info("%s: a %s (vision-language) checkpoint: rlsp trains its text model only; the vision tower (model.visual.*) "
                 "is not loaded (a run whose rows carry images loads it: rlsp.data.vision_run), and the HF export "
                 "(actor_hf) is the text causal LM alone (model_type %s, model.* names)",
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
