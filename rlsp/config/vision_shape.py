"""The vision tower of a vision-language checkpoint as the layout planner needs it, read from its config.json.

Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE (rlsp.models.vision_inputs.VISION_FAMILIES) train with their tower: its
parameters sit in FSDP2's root unit (rlsp.engine.parallelize shards the text layers one by one, everything else at
once), and while images train each rank encodes its share of the micro-batch's images (rlsp.models.vision_lm).
Parameter counts follow transformers' tower of each family (equal to the numel of its `model.visual`, tested on tiny
models): a patch embedding (a Conv3d over in_channels x temporal_patch x patch x patch pixels), `depth` blocks of
attention (fused qkv and an output projection, with biases) and an MLP (Qwen2.5-VL: gated, RMSNorms; Qwen3-VL: two
matrices, LayerNorms, plus a learned position table), then the merger of spatial_merge^2 patches into one text-width
token (Qwen3-VL adds one merger per deepstack level). The text model of these checkpoints reads as its text
equivalent (`TEXT_EQUIVALENT`): the same layers.

No torch, no transformers.

Legend: h tower width, I tower MLP width, m spatial merge, P pixel values per patch, o text width (out_hidden_size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Vision-language model types whose text model has the layers of a text family the planner counts.
TEXT_EQUIVALENT = {"qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe"}
_LAYER_NORM_TOWERS = ("qwen3_vl", "qwen3_vl_moe")  # LayerNorm (weight and bias), two-matrix MLP, position table


@dataclass(frozen=True)
class VisionTower:
    """A vision tower's size: its parameters and what its activations scale with."""

    params: int
    hidden: int  # h
    depth: int
    intermediate: int  # I
    merge: int  # m: m x m patches make one image token
    out_hidden: int  # o
    pixels: int = 0  # P
    gated_rms: bool = False  # Qwen2.5-VL's blocks: RMSNorms (fp32 upcast) and a gated MLP; else LayerNorms, 2 matrices
    deepstack: int = 0  # Qwen3-VL's deepstack mergers


def _get(vcfg: dict[str, Any], key: str, default: Any = None) -> Any:
    value = vcfg.get(key, default)
    if value is None:
        raise ValueError(f"vision_config lacks {key!r}; pass the config.json transformers writes for the model")
    return value


def vision_tower(model_type: str, vcfg: dict[str, Any]) -> VisionTower:
    """The tower of a `model_type` checkpoint (one of TEXT_EQUIVALENT) from its `vision_config` dict."""
    if model_type not in TEXT_EQUIVALENT:
        raise ValueError(f"model_type={model_type!r} has no vision tower the planner counts; legal: {list(TEXT_EQUIVALENT)}")
    h, depth, inter = _get(vcfg, "hidden_size"), _get(vcfg, "depth"), _get(vcfg, "intermediate_size")
    m, out = _get(vcfg, "spatial_merge_size", 2), _get(vcfg, "out_hidden_size")
    tps = _get(vcfg, "temporal_patch_size", 2)
    pixels = _get(vcfg, "in_channels", 3) * tps * _get(vcfg, "patch_size") ** 2
    attn = 3 * h * h + 3 * h + h * h + h  # fused qkv and the output projection, with biases
    wide = h * m * m
    merger = wide * wide + wide + wide * out + out  # [m^2 h -> m^2 h -> o], with biases
    if model_type in _LAYER_NORM_TOWERS:
        block = 2 * 2 * h + attn + 2 * h * inter + inter + h
        deep = len(vcfg.get("deepstack_visual_indexes") or [])
        params = (pixels * h + h + _get(vcfg, "num_position_embeddings") * h + depth * block
                  + 2 * h + merger + deep * (2 * wide + merger))
        return VisionTower(params, h, depth, inter, m, out, pixels, deepstack=deep)
    block = 2 * h + attn + 3 * h * inter + 2 * inter + h
    params = pixels * h + depth * block + h + merger
    return VisionTower(params, h, depth, inter, m, out, pixels, gated_rms=True)


def tower_saved_bytes(tower: VisionTower, image_tokens: int, dtype_bytes: int, checkpointed: bool = False) -> float:
    """Bytes the tower saves for backward while it encodes images of `image_tokens` text tokens (m^2 patches each),
    measured op by op (autograd's saved tensors, sdpa attention, bf16) on Qwen2.5-VL and Qwen3-VL towers of widths
    256 / 512 and MLP widths 512 / 1024, fitted exactly: per block and patch 11 [h] tensors in the compute dtype
    (norm outputs, q, k, v, attention output, projections' inputs, rotary copies), Qwen2.5-VL's RMSNorms their fp32
    upcast (2 x 4 h), the MLP 4 [I] tensors (gated: gate, up, activation, product) or 2 (fc1 output, activation),
    and 24 bytes of per-row statistics; outside the blocks the pixel input, 7 (Qwen2.5-VL) or 5 (Qwen3-VL) [h]
    tensors of the patch embedding and the merger, and 3 per deepstack merger. `checkpointed` (gradient checkpointing
    reaches the tower's blocks too: transformers' GradientCheckpointingLayer): each block keeps its [h] input, and
    backward recomputes one block at a time (derived from the same terms, not measured)."""
    e, h = dtype_bytes, tower.hidden
    patches = image_tokens * tower.merge * tower.merge
    block = (11 * e + (8 if tower.gated_rms else 0)) * h + (4 if tower.gated_rms else 2) * e * tower.intermediate + 24
    outside = tower.pixels * e + ((7 if tower.gated_rms else 5) + 3 * tower.deepstack) * e * h
    if checkpointed:
        return float(patches * (tower.depth * e * h + block + outside))
    return float(patches * (tower.depth * block + outside))
