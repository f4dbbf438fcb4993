"""Tiny random Qwen2.5-VL and Qwen3-VL models (transformers' own config classes) and padded rows with images.

Vision towers of depth 2, hidden 32, patch 4 (pixel rows of 3 x 2 x 4 x 4 = 96 values), spatial merge 2; text models
of 2 layers with 6 q / 2 kv heads of dim 8 (Ulysses 4 splits them 2+2+1+1), mrope sections [2, 1, 1], vocab 64.
Qwen2.5-VL's tower mixes a windowed and a full-attention block; Qwen3-VL's feeds deepstack features from both blocks
into both text layers; Qwen3-VL-MoE is Qwen3-VL with 4 experts, 2 per token, in both text layers. Token ids 60-63 are the image, video, vision-start and vision-end tokens; text tokens are
drawn from 3..59.
"""

from __future__ import annotations

import torch
from transformers import Qwen2_5_VLConfig, Qwen3VLConfig, Qwen3VLMoeConfig

from rlsp.data.batch import Batch

VL_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
IMAGE, VIDEO, V_START, V_END = 60, 61, 62, 63
PIXEL_DIM = 3 * 2 * 4 * 4
MERGE = 2
TEXT = dict(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, head_dim=8, initializer_range=0.05, bos_token_id=None, eos_token_id=None,
            pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                             "mrope_section": [2, 1, 1]})
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, in_channels=3, patch_size=4,
              spatial_merge_size=MERGE, temporal_patch_size=2, out_hidden_size=48, initializer_range=0.05)
TOKEN_IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=V_START,
                 vision_end_token_id=V_END, tie_word_embeddings=False)


def vl_config(family: str):
    """The tiny config of `family` (one of VL_FAMILIES)."""
    if family == "qwen2_5_vl":
        vision = {**VISION, "window_size": 16, "fullatt_block_indexes": [1], "tokens_per_second": 2}
        return Qwen2_5_VLConfig(text_config=dict(TEXT), vision_config=vision, **TOKEN_IDS)
    if family == "qwen3_vl":
        vision = {**VISION, "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1],
                  "hidden_act": "gelu_pytorch_tanh"}
        return Qwen3VLConfig(text_config=dict(TEXT), vision_config=vision, **TOKEN_IDS)
    if family == "qwen3_vl_moe":
        vision = {**VISION, "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1],
                  "hidden_act": "gelu_pytorch_tanh"}
        text = {**TEXT, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                "tie_word_embeddings": False}
        return Qwen3VLMoeConfig(text_config=text, vision_config=vision, **TOKEN_IDS)
    raise ValueError(f"family={family!r}; legal: {VL_FAMILIES}")


def write_tiny_vl(family: str, out_dir: str, seed: int = 0) -> str:
    """A loadable model directory (fp32 random weights) of the tiny `family` model."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(vl_config(family), dtype=torch.float32)
    model.save_pretrained(out_dir)
    return out_dir


def _image_tokens(grid_thw: list[int]) -> list[int]:
    t, h, w = grid_thw
    return [V_START] + [IMAGE] * (t * h * w // MERGE**2) + [V_END]


def vl_rows(grids_per_row: list[list[list[int]]], prompt_len: int, response_len: int, seed: int = 0) -> Batch:
    """Padded rows (prompt left-padded to `prompt_len`, response right-padded to `response_len`) whose prompts hold
    the images of `grids_per_row` (per row a list of [t, h, w] patch grids), with random pixels, the training fields
    of tests/distributed/test_fsdp_engine.py and meta["multi_modal_inputs"] (None for a row without images)."""
    g = torch.Generator().manual_seed(seed)
    B, L = len(grids_per_row), prompt_len + response_len
    input_ids, mask = torch.zeros(B, L, dtype=torch.long), torch.zeros(B, L, dtype=torch.long)
    entries = []
    for b, grids in enumerate(grids_per_row):
        prompt = [int(x) for x in torch.randint(3, 60, (1 + b % 3,), generator=g)]
        for grid in grids:
            prompt += _image_tokens(grid) + [int(x) for x in torch.randint(3, 60, (2,), generator=g)]
        if len(prompt) > prompt_len:
            raise ValueError(f"row {b}: a prompt of {len(prompt)} tokens does not fit prompt_len={prompt_len}")
        r_len = 1 + (3 * b + 2) % response_len
        response = torch.randint(3, 60, (r_len,), generator=g)
        input_ids[b, prompt_len - len(prompt):prompt_len] = torch.tensor(prompt)
        input_ids[b, prompt_len:prompt_len + r_len] = response
        mask[b, prompt_len - len(prompt):prompt_len + r_len] = 1
        entries.append(None if not grids else {
            "pixel_values": torch.randn(sum(t * h * w for t, h, w in grids), PIXEL_DIM, generator=g),
            "image_grid_thw": torch.tensor(grids, dtype=torch.long)})
    resp_mask = mask[:, prompt_len:].float()
    fields = {name: (torch.randn(B, response_len, generator=g) * scale - shift) * resp_mask
              for name, scale, shift in (("old_logprobs", 0.3, 3.0), ("ref_logprobs", 0.3, 3.0), ("advantages", 1.0, 0.0))}
    return Batch.from_dict({"input_ids": input_ids, "attention_mask": mask, "response_mask": resp_mask, **fields},
                           meta={"multi_modal_inputs": entries})


def hf_logprobs(model, rows: Batch) -> torch.Tensor:
    """transformers' own forward of the padded rows: log p(next token) [B, L-1] (meaningless where masked)."""
    ids, mask = rows["input_ids"], rows["attention_mask"]
    entries = [e for e in rows.meta["multi_modal_inputs"] if e is not None]
    kwargs = {}
    if entries:
        kwargs = dict(pixel_values=torch.cat([e["pixel_values"] for e in entries]),
                      image_grid_thw=torch.cat([e["image_grid_thw"] for e in entries]),
                      mm_token_type_ids=(ids == IMAGE).int())
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False, **kwargs).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
