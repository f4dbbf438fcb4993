"""The planner's model shape (rlsp.config.model_shape, rlsp.config.layer_kinds) against transformers' own models of every
family rlsp trains, built from tiny configs (tests/tiny_*.py): parameter counts per layer and in total, exactly; the
parameters a token runs through in MoE layers; multi-latent attention's head dims; transformers' decoding cache
(KV per token, sliding windows, MLA's latent, linear attention's recurrent and conv state), byte for byte; and the
memory model's per-kind activation terms (windowed layers O(tokens x window) on the torch banded kernel, MoE by
the active experts, auto_memory equal to the planner)."""

from __future__ import annotations

import pytest
import torch
from tiny_deepseek import deepseek_config
from tiny_gemma import gemma_config
from tiny_gpt_oss import gpt_oss_config
from tiny_linear import linear_config
from tiny_moe import MOE_FAMILIES, moe_config
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from rlsp.config.auto_memory import WINDOW_CHUNK, activation_bytes
from rlsp.config.layout import RoleLayout, World
from rlsp.config.model_shape import shape_from_config
from rlsp.plan.memory import HeadShare, MemoryOptions, Workload, decoder_saved_bytes, layer_saved_bytes

_DENSE = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
CONFIGS = {
    "gemma2": lambda: gemma_config("gemma2"), "gemma3_text": lambda: gemma_config("gemma3_text"),
    "gpt_oss": gpt_oss_config,
    **{f"deepseek_{v}": (lambda v=v: deepseek_config(v)) for v in ("v3", "v3_no_q_lora", "v2")},
    "deepseek_v3_bias": lambda: deepseek_config("v3", attention_bias=True),
    **{f: (lambda f=f: linear_config(f)) for f in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")},
    **{f: (lambda f=f: moe_config(f)) for f in MOE_FAMILIES},
    "qwen2": lambda: Qwen2Config(**_DENSE), "qwen3": lambda: Qwen3Config(**_DENSE, head_dim=8),
    "llama_biases": lambda: LlamaConfig(**_DENSE, attention_bias=True, mlp_bias=True),
}


@pytest.fixture(scope="module")
def built() -> dict[str, tuple[object, torch.nn.Module]]:
    out = {}
    for name, make in CONFIGS.items():
        config = make()
        torch.manual_seed(0)
        out[name] = (config, AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())
    return out


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameter_count_equals_transformers(built, name):
    config, model = built[name]
    shape = shape_from_config(config.to_dict())
    assert [k.params for k in shape.kinds] == [_numel(layer) for layer in model.model.layers]
    assert shape.params == _numel(model)
    assert shape.layer_params == max(_numel(layer) for layer in model.model.layers)


def _expert_numel(layer: torch.nn.Module) -> tuple[int, int]:
    """(one routed expert's parameters, routed experts) of a layer's MoE block, from the module itself."""
    experts = layer.mlp.experts
    count = next(p for p in experts.parameters()).shape[0]
    return _numel(experts) // count, count


@pytest.mark.parametrize("name", ["gpt_oss", "deepseek_v3", "qwen3_next", "qwen3_5_moe_text", *MOE_FAMILIES])
def test_active_parameters_leave_out_the_experts_a_token_skips(built, name):
    config, model = built[name]
    shape = shape_from_config(config.to_dict())
    k, active = config.num_experts_per_tok, 0
    for layer in model.model.layers:
        per_expert, count = _expert_numel(layer) if hasattr(layer.mlp, "experts") else (0, k)
        active += _numel(layer) - (count - k) * per_expert
    assert shape.active_decoder_params == active < shape.decoder_params


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_no_q_lora", "deepseek_v2"])
def test_mla_head_dims(built, name):
    shape = shape_from_config(built[name][0].to_dict())
    assert (shape.q_heads, shape.kv_heads, shape.head_dim, shape.v_dim) == (6, 6, 10, 6)


def _cache_bytes(cache: object) -> int:
    total = 0
    for layer in cache.layers:
        for value in vars(layer).values():
            tensors = value.values() if isinstance(value, dict) else [value]
            total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor) and t.dim() > 0)
    return total


@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss", "deepseek_v3", "qwen3_next", "qwen3_5_text", "qwen2"])
@pytest.mark.parametrize("tokens", [3, 7])
def test_decoding_cache_bytes_equal_transformers(built, name, tokens):
    config, model = built[name]
    shape = shape_from_config(config.to_dict())
    with torch.no_grad():
        cache = model(torch.arange(tokens)[None] % 40 + 1, use_cache=True).past_key_values
    assert _cache_bytes(cache) == shape.kv_cache_bytes(tokens, 4) + shape.state_bytes_per_sequence(4)


def _workload(shape, tokens: int, seq_len: int) -> Workload:
    return Workload(RoleLayout(World(1, 1)), tokens, seq_len, HeadShare(shape.q_heads, shape.kv_heads))


def test_windowed_layers_keep_tokens_times_window_on_the_torch_kernel(built):
    shape = shape_from_config(built["gemma3_text"][0].to_dict())
    sliding, full = shape.kinds[0], shape.kinds[2]
    w, e = _workload(shape, 4096, 4096), 2
    torch_path, flash = MemoryOptions(e, flash=False), MemoryOptions(e, flash=True)
    band = 4 + WINDOW_CHUNK - 1  # window 4: a block's keys per query
    extra = layer_saved_bytes(shape, w, torch_path, sliding) - layer_saved_bytes(shape, w, flash, sliding)
    assert extra == 4096 * shape.q_heads * band * e
    assert layer_saved_bytes(shape, w, torch_path, full) == layer_saved_bytes(shape, w, flash, full)
    short = _workload(shape, 4096, 64)  # sequences shorter than the band: at most the sequence
    extra = layer_saved_bytes(shape, short, torch_path, sliding) - layer_saved_bytes(shape, short, flash, sliding)
    assert extra == 4096 * shape.q_heads * 64 * e


def test_moe_activations_follow_the_active_experts(built):
    few, many = (shape_from_config(moe_config("mixtral", num_local_experts=n).to_dict()) for n in (4, 16))
    assert many.params > few.params
    w = _workload(few, 1024, 1024)
    router = 1024 * (16 - 4) * 4 * few.layers  # only the fp32 router logits grow with the experts
    assert decoder_saved_bytes(many, w, MemoryOptions(2)) - decoder_saved_bytes(few, w, MemoryOptions(2)) == router


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss", "deepseek_v3", "qwen3_next", "mixtral"])
def test_auto_memory_equals_the_planner_per_kind(built, name):
    shape = shape_from_config(built[name][0].to_dict())
    planner = decoder_saved_bytes(shape, _workload(shape, 2048, 2048), MemoryOptions(dtype_bytes=2))
    assert activation_bytes(shape, 2048, 2) == pytest.approx(planner, rel=1e-12)
