"""Trainer names -> checkpoint names for MoE models (rlsp/rollout/moe_names.py), and the CPU vLLM expert-width check.

Every fused experts tensor of transformers' in-memory model (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
[E, H, I]) must become exactly the per-expert tensors `save_pretrained` writes (what vLLM loads at start): same
names, same values, bit for bit; other tensors keep name and value.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from tiny_moe import MOE_FAMILIES, moe_config
from transformers import AutoModelForCausalLM, GptOssConfig, LlamaConfig, Qwen2Config

from rlsp.rollout.moe_names import build_checkpoint_names
from rlsp.rollout.support import check_cpu_moe_width, check_rollout_support

# per family: the checkpoint module of a layer's experts, and the names of gate, up and down projections
LAYOUT = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
          "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
          "olmoe": ("mlp", "gate_proj", "up_proj", "down_proj"),
          "glm4_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
          "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def family_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(moe_config(request.param), dtype=torch.float32)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, load_file(str(path / "model.safetensors"))


def test_names_and_values_equal_the_saved_checkpoint(family_model) -> None:
    family, model, saved = family_model
    namer = build_checkpoint_names(model.config)
    assert namer is not None
    converted = dict(namer((name, p.detach()) for name, p in model.named_parameters()))
    buffers = {name for name, _ in model.named_buffers()}  # glm4_moe's router bias: saved, not trained, not sent
    assert sorted(converted) == sorted(set(saved) - buffers)
    for name, tensor in converted.items():
        assert torch.equal(tensor, saved[name]), name


def test_every_fused_tensor_becomes_its_expert_slices(family_model) -> None:
    family, model, _ = family_model
    owner, gate, up, down = LAYOUT[family]
    namer = build_checkpoint_names(model.config)
    fused = {name: p.detach() for name, p in model.named_parameters() if name.endswith(("gate_up_proj", "down_proj"))
             and ".experts." in name}
    assert len(fused) == 2 * sum(1 for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    for name, tensor_EXY in fused.items():
        prefix = name.split(".mlp.experts.")[0] + f".{owner}.experts"
        got = namer.convert(name, tensor_EXY)
        if name.endswith("gate_up_proj"):
            inter = tensor_EXY.shape[1] // 2
            want = {f"{prefix}.{e}.{gate}.weight": tensor_EXY[e, :inter] for e in range(tensor_EXY.shape[0])}
            want |= {f"{prefix}.{e}.{up}.weight": tensor_EXY[e, inter:] for e in range(tensor_EXY.shape[0])}
        else:
            want = {f"{prefix}.{e}.{down}.weight": tensor_EXY[e] for e in range(tensor_EXY.shape[0])}
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[k], want[k]) for k in want), name


def test_conversion_streams_one_parameter_at_a_time() -> None:
    model = AutoModelForCausalLM.from_config(moe_config("qwen3_moe"), dtype=torch.float32)
    pulled: list[str] = []

    def sent():
        for name, p in model.named_parameters():
            pulled.append(name)
            yield name, p.detach()

    out = build_checkpoint_names(model.config)(sent())
    for name, _ in out:
        if ".experts." in name:
            assert pulled[-1].endswith("gate_up_proj")  # the first expert slice comes before the next parameter
            break


@pytest.mark.parametrize("config", [LlamaConfig(), Qwen2Config(), GptOssConfig()], ids=["llama", "qwen2", "gpt_oss"])
def test_families_without_conversion_pass_through(config) -> None:
    assert build_checkpoint_names(config) is None  # gpt_oss checkpoints keep the fused experts


def test_cpu_moe_width_check() -> None:
    assert all(check_rollout_support(moe_config(family), "vllm", "cpu") is None for family in MOE_FAMILIES)
    assert check_cpu_moe_width(Qwen2Config(intermediate_size=40)) is None  # dense: no experts
    padded = moe_config("qwen3_moe", moe_intermediate_size=40)
    message = check_rollout_support(padded, "vllm", "cpu")
    assert message is not None and "moe_intermediate_size=40" in message and "rollout.name=hf" in message
    assert check_rollout_support(padded, "vllm", "cuda") is None and check_rollout_support(padded, "hf", "cpu") is None
    mixtral = moe_config("mixtral", intermediate_size=64)
    assert check_cpu_moe_width(mixtral, tp=2) is None
    assert "intermediate_size=64 (16 per rollout tp rank)" in check_cpu_moe_width(mixtral, tp=4)


def test_expert_checksum_sees_moved_elements_and_only_them() -> None:
    from rlsp.rollout.vllm_engine import _bits_checksum

    gen = torch.Generator().manual_seed(0)
    w_EXY = torch.randn(4, 6, 8, generator=gen)
    assert _bits_checksum(w_EXY) == _bits_checksum(w_EXY.clone())  # same bits, same number
    assert _bits_checksum(w_EXY) != _bits_checksum(w_EXY.transpose(1, 2).reshape(4, 6, 8))  # a repack moves elements
    assert _bits_checksum(w_EXY) != _bits_checksum(w_EXY.flip(0))  # experts swapped
    assert _bits_checksum(w_EXY.bfloat16()) != _bits_checksum(w_EXY.bfloat16().flip(1))
