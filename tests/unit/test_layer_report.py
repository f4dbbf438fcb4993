"""rlsp.config.layer_report: per layer kind, how a layout splits the heads and which kernel and MLP run it, on tiny
configs of every family (transformers' own config classes, tests/tiny_*.py), line for line; and `python -m
rlsp.check` prints it under "layers" for a tiny Gemma 2 model directory."""

from __future__ import annotations

import pandas as pd
import pytest
from tiny_deepseek import deepseek_config
from tiny_gemma import gemma_config, write_tiny_gemma
from tiny_gpt_oss import gpt_oss_config
from tiny_linear import linear_config
from transformers import Qwen2Config

from rlsp.check import main as check_main
from rlsp.config.layer_report import describe_layers, layer_section
from rlsp.config.layout import RoleLayout, World
from rlsp.parallel.heads import plan_head_layout

GEMMA2_U4 = [
    "sliding_attention x 2 (layers 0, 2): window 4, soft-cap 2, 6 q / 2 kv heads of dim 8; Ulysses 4 splits q 2+1+2+1, "
    "kv 1+1+1+1 (replicated); torch banded kernel on cpu / flash_attn window + softcap on cuda; dense MLP 64",
    "full_attention x 1 (layer 1): soft-cap 2, 6 q / 2 kv heads of dim 8; Ulysses 4 splits q 2+1+2+1, kv 1+1+1+1 "
    "(replicated); torch banded kernel on cpu / flash_attn softcap on cuda; dense MLP 64",
]
GEMMA3_TP2 = [
    "sliding_attention x 2 (layers 0, 1): window 4, 6 q / 2 kv heads of dim 8; tp 2: 3 q / 1 kv heads per tp rank; "
    "Ulysses 1: every head on each rank; torch banded kernel on cpu / flash_attn window on cuda; dense MLP 64",
    "full_attention x 1 (layer 2): 6 q / 2 kv heads of dim 8; tp 2: 3 q / 1 kv heads per tp rank; Ulysses 1: every "
    "head on each rank; SDPA on cpu / flash_attn varlen on cuda; dense MLP 64",
]
GPT_OSS_U2 = [
    "sliding_attention x 2 (layers 0, 2): window 4, attention sinks, 6 q / 2 kv heads of dim 8; Ulysses 2 splits q "
    "3+3, kv 1+1; torch banded kernel with sinks on cpu and cuda (flash_attn has no sinks); MoE 4 experts of 16, 2 per "
    "token",
    "full_attention x 1 (layer 1): attention sinks, 6 q / 2 kv heads of dim 8; Ulysses 2 splits q 3+3, kv 1+1; torch "
    "banded kernel with sinks on cpu and cuda (flash_attn has no sinks); MoE 4 experts of 16, 2 per token",
]
_MLA = ("multi-latent, 6 q / 6 kv heads after the latent expansion, q/k dim 10 (6 nope + 4 rope), v dim 6, {ranks}; "
        "Ulysses 4 splits q 2+2+1+1, kv 2+2+1+1; SDPA on cpu / flash_attn on cuda (v zero-padded to 10, output sliced "
        "back); ")
DEEPSEEK_V3_U4 = [
    "full_attention x 1 (layer 0): " + _MLA.format(ranks="q_lora 12, kv_lora 10") + "dense MLP 48",
    "full_attention x 2 (layers 1, 2): " + _MLA.format(ranks="q_lora 12, kv_lora 10") +
    "MoE 8 experts of 16, 2 per token + shared 16",
]
_LINEAR = ("linear_attention x 2 (layers 0, 2): Gated DeltaNet, 2 key / 4 value heads (key dim 8, value dim 8); 2 "
           "key-head groups {split}; conv 4, state 8x8 per value head, no KV cache; transformers' torch chunked rule "
           "per packed row on cpu / flash-linear-attention chunk_gated_delta_rule on cuda (when installed); ")
QWEN3_NEXT_U4 = [
    _LINEAR.format(split="split 1+1+0+0, 2 rank(s) idle") + "MoE 3 experts of 16, 2 per token + shared 16",
    "full_attention x 1 (layer 1): output-gated q, 4 q / 2 kv heads of dim 16; Ulysses 4 splits q 1+1+1+1, kv 1+1+1+1 "
    "(replicated); SDPA on cpu / flash_attn varlen on cuda; MoE 3 experts of 16, 2 per token + shared 16",
]
QWEN3_5_U2 = [
    _LINEAR.format(split="split 1+1") + "dense MLP 48",
    "full_attention x 1 (layer 1): output-gated q, 4 q / 2 kv heads of dim 16; Ulysses 2 splits q 2+2, kv 1+1; SDPA on "
    "cpu / flash_attn varlen on cuda; dense MLP 48",
]
QWEN3_5_TP2_U2 = [
    _LINEAR.format(split="split 1+0, 1 rank(s) idle").replace("2 key-head groups", "2 key-head groups, tp 2: 1 per tp "
                                                                "rank,") + "dense MLP 48",
    "full_attention x 1 (layer 1): output-gated q, 4 q / 2 kv heads of dim 16; tp 2: 2 q / 1 kv heads per tp rank; "
    "Ulysses 2 splits q 1+1, kv 1+1 (replicated); SDPA on cpu / flash_attn varlen on cuda; dense MLP 48",
]
QWEN2_RING = ["full_attention x 2 (layers 0, 1): 4 q / 2 kv heads of dim 8; tp 2: 2 q / 1 kv heads per tp rank; "
              "Ulysses 2 splits q 1+1, kv 1+1 (replicated); ring attention over 2 ranks, each holding 1/2 of the stream; "
              "dense MLP 48"]
_QWEN2 = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2)

CASES = {
    "gemma2 ulysses 4": (lambda: gemma_config("gemma2"), (4, 1, 1), GEMMA2_U4),
    "gemma3_text tp 2": (lambda: gemma_config("gemma3_text"), (1, 1, 2), GEMMA3_TP2),
    "gpt_oss ulysses 2": (gpt_oss_config, (2, 1, 1), GPT_OSS_U2),
    "deepseek_v3 ulysses 4": (lambda: deepseek_config("v3"), (4, 1, 1), DEEPSEEK_V3_U4),
    "qwen3_next ulysses 4": (lambda: linear_config("qwen3_next"), (4, 1, 1), QWEN3_NEXT_U4),
    "qwen3_5_text ulysses 2": (lambda: linear_config("qwen3_5_text"), (2, 1, 1), QWEN3_5_U2),
    "qwen3_5_text tp 2 ulysses 2": (lambda: linear_config("qwen3_5_text"), (2, 1, 2), QWEN3_5_TP2_U2),
    "qwen2 ulysses 2 ring 2 tp 2": (lambda: _QWEN2, (2, 2, 2), QWEN2_RING),
}


@pytest.mark.parametrize("case", list(CASES))
def test_lines_per_layer_kind(case):
    build, (ulysses, ring, tp), expected = CASES[case]
    assert describe_layers(build().to_dict(), plan_head_layout, ulysses, ring, tp) == expected


def test_unknown_layer_kind_is_refused_by_name():
    cfg = gemma_config("gemma3_text").to_dict()
    cfg["layer_types"] = ["sliding_attention", "chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"layer types \['chunked_attention'\] have no shape model"):
        describe_layers(cfg, plan_head_layout, 2)
    title, *lines = layer_section(cfg, RoleLayout(World(1, 2), ulysses=2), plan_head_layout)
    assert title == "layers (actor: ulysses 2, ring 1, tp 1)"
    assert lines == ["not described: gemma3_text: layer types ['chunked_attention'] have no shape model in rlsp's "
                     "planner (known: ['full_attention', 'sliding_attention', 'linear_attention'])"]


def test_check_prints_the_layers(tmp_path, capsys):
    model = write_tiny_gemma("gemma2", str(tmp_path / "gemma2"))
    rows = [{"data_source": "rlsp/arithmetic", "prompt": [{"role": "user", "content": "1+1"}],
             "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": i}} for i in range(4)]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    rc = check_main(["trainer.device=cpu", f"trainer.cache_dir={tmp_path / 'cache'}",
                     f"trainer.default_local_dir={tmp_path / 'run'}", f"data.train_files={tmp_path / 'train.parquet'}",
                     "data.val_files=null", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                     "trainer.total_training_steps=2", "trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.name=hf",
                     f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4",
                     "actor_rollout_ref.ref.ulysses_sequence_parallel_size=4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    section = "layers (actor: ulysses 4, ring 1, tp 1):\n" + "".join(f"  {line}\n" for line in GEMMA2_U4)
    assert section in out, out
