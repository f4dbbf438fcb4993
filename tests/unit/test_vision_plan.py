"""The layout planner reads vision-language checkpoints: the text model's layers plus the vision tower.

For the tiny Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE of tests/tiny_vl.py (tied and untied output layer), the planner's
parameter count equals the numel of transformers' model built from the same config.json (exact integers), the
tower's alone that of `model.visual`; the tower sits in the root unit. With image tokens in the data the actor's saved
activations grow by the tower's (`rlsp.config.vision_shape.tower_saved_bytes` of the rank's share of the images), that
term matches what autograd keeps for a tiny tower's forward, and `rlsp.plan --image-tokens` refuses a text model by
name.
"""

from __future__ import annotations

import pytest
import torch
from tiny_vl import VL_FAMILIES, vl_config

from rlsp.config.layout import RoleLayout, World
from rlsp.config.model_shape import read_model_shape
from rlsp.config.vision_shape import tower_saved_bytes, vision_tower
from rlsp.plan.cli import build_request, parse_args
from rlsp.plan.memory import HeadShare, MemoryOptions, Workload, activation_terms


@pytest.fixture(scope="module", params=[(f, tie) for f in VL_FAMILIES for tie in (False, True)],
                ids=lambda p: f"{p[0]}-{'tied' if p[1] else 'untied'}")
def vl_dir(request, tmp_path_factory):
    """A directory with the config.json of the tiny `family` model (tied on the top-level config, as checkpoints say it)."""
    family, tied = request.param
    config = vl_config(family)
    config.tie_word_embeddings = tied
    path = str(tmp_path_factory.mktemp(family))
    config.save_pretrained(path)
    return path


def test_parameter_count_equals_the_built_model(vl_dir):
    from transformers import AutoConfig, AutoModelForImageTextToText

    shape = read_model_shape(vl_dir)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(vl_dir), dtype=torch.float32)
    assert shape.tied == (model.lm_head.weight is model.get_input_embeddings().weight)
    assert shape.vision.params == sum(p.numel() for p in model.model.visual.parameters())
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.root_params == shape.params - shape.decoder_params  # the tower is in FSDP's root unit
    assert shape.legal_tp() == [1]  # rlsp's tensor parallelism refuses vision-language models


def test_image_tokens_add_the_towers_activations(vl_dir):
    shape = read_model_shape(vl_dir)
    layout = RoleLayout(World(1, 2), ulysses=2)
    text = Workload(layout, 1024, 512, HeadShare(3, 1))
    images = Workload(layout, 1024, 512, HeadShare(3, 1), image_tokens=128)
    assert images.rank_image_tokens == 1024 * 128 // 512  # a quarter of the rank's shard of the stream
    grown = {}
    for ckpt in (False, True):
        opts = MemoryOptions(dtype_bytes=2, checkpointing=ckpt)
        saved = (activation_terms(shape, w, "actor", opts)["saved"] for w in (images, text))
        grown[ckpt] = next(saved) - next(saved)
        assert grown[ckpt] == tower_saved_bytes(shape.vision, 256, 2, checkpointed=ckpt)
        critic = (activation_terms(shape, w, "critic", opts)["saved"] for w in (images, text))
        assert next(critic) - next(critic) == grown[ckpt]  # a vision-language critic encodes the same images
    assert grown[False] > grown[True] > 0  # checkpointing reaches the tower's blocks too


def test_plan_image_tokens_refuse_a_text_model(tmp_path):
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=2).save_pretrained(tmp_path)
    args = ["--model", str(tmp_path), "--gpus-per-node", "2", "--gpu-memory-gib", "80", "--seq-len", "4096",
            "--image-tokens", "256"]
    with pytest.raises(ValueError, match="--image-tokens=256: legal: 0, or 1..--prompt-len"):
        build_request(parse_args(args))
    build_request(parse_args(args[:-2]))  # text data: accepted


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_tower_saved_bytes_match_autograds_saved_tensors(family):
    """The tower's activation term against what autograd actually keeps (bf16, sdpa) for a tiny tower's forward over
    64 and 256 patches: within 5 % (measured 0.2 % for Qwen2.5-VL, 1.9 % for Qwen3-VL's deepstack tower)."""
    from transformers import AutoModelForImageTextToText

    config = vl_config(family)
    impl = {"text_config": "sdpa", "vision_config": "sdpa", "": "sdpa"}
    visual = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16, attn_implementation=impl).model.visual
    weights = {p.untyped_storage().data_ptr() for p in visual.parameters()}
    tower = vision_tower(family, config.vision_config.to_dict())
    for grid in ([1, 8, 8], [1, 16, 16]):
        saved = {}

        def keep(x, saved=saved):
            if x.untyped_storage().data_ptr() not in weights:
                saved[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
            return x

        patches = grid[1] * grid[2]
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda x: x):
            visual(torch.randn(patches, tower.pixels, dtype=torch.bfloat16), grid_thw=torch.tensor([grid]))
        estimate = tower_saved_bytes(tower, patches // tower.merge**2, 2)
        assert abs(sum(saved.values()) / estimate - 1) < 0.05, (sum(saved.values()), estimate)
