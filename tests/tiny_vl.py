"""Tiny random Qwen2.5-VL and Qwen3-VL models (transformers' own config classes) and padded rows with images.

Vision towers of depth 2, hidden 32, patch 4 (pixel rows of 3 x 2 x 4 x 4 = 96 values), spatial merge 2; text models
of 2 layers with 6 q / 2 kv heads of dim 8 (Ulysses 4 splits them 2+2+1+1), mrope sections [2, 1, 1], vocab 64.
Qwen2.5-VL's tower mixes a windowed and a full-attention block; Qwen3-VL's feeds deepstack features from both blocks
into both text layers; Qwen3-VL-MoE is Qwen3-VL with 4 experts, 2 per token, in both text layers. Token ids 60-63 are the image, video, vision-start and vision-end tokens; text tokens are
drawn from 3..59.

Qwen3.5 / Qwen3.5-MoE (HYBRID_VL_FAMILIES, loaded with their tower): tests/tiny_linear.py's hybrid text model (Gated
DeltaNet, gated full attention, 4 q / 2 kv heads of dim 16; the MoE one with 3 experts and a shared expert) over the
same vocabulary, rotary on the whole head (8 frequencies, interleaved mrope sections [3, 3, 2]: every section
rotates), its conditioning (initializer_range 0.08, decay rates A in [0.3, 3]); the tower as above (no deepstack).
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


HYBRID_VL_FAMILIES = ("qwen3_5", "qwen3_5_moe")


def hybrid_vl_config(family: str, tie_word_embeddings: bool = False):
    """The tiny Qwen3.5 (`family` one of HYBRID_VL_FAMILIES) vision-language config."""
    from tiny_linear import linear_config
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    if family not in HYBRID_VL_FAMILIES:
        raise ValueError(f"family={family!r}; legal: {HYBRID_VL_FAMILIES}")
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0, "mrope_section": [3, 3, 2],
            "mrope_interleaved": True}
    text = linear_config(f"{family}_text", vocab=64, initializer_range=0.08, pad_token_id=0, bos_token_id=None,
                         eos_token_id=None, rope_parameters=rope, tie_word_embeddings=tie_word_embeddings)
    vision = {**VISION, "out_hidden_size": text.hidden_size, "num_position_embeddings": 16}
    config_cls = Qwen3_5Config if family == "qwen3_5" else Qwen3_5MoeConfig
    return config_cls(text_config=text.to_dict(), vision_config=vision,
                      **{**TOKEN_IDS, "tie_word_embeddings": tie_word_embeddings})


def build_tiny_vl(config, seed: int = 0):
    """transformers' random-init model of a tiny config (fp32; a Qwen3.5 one's decay rates conditioned)."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.A_log"):
                param.copy_(torch.linspace(0.3, 3.0, param.numel()).log())
    return model


def write_tiny_vl(family: str, out_dir: str, seed: int = 0, tie_word_embeddings: bool = False) -> str:
    """A loadable model directory (fp32 random weights) of the tiny `family` model (VL_FAMILIES, HYBRID_VL_FAMILIES)."""
    hybrid = family in HYBRID_VL_FAMILIES
    if tie_word_embeddings and not hybrid:  # on the top-level config only, as Qwen2.5-VL / Qwen3-VL checkpoints say it
        config = vl_config(family)
        config.tie_word_embeddings = True
    else:
        config = hybrid_vl_config(family, tie_word_embeddings) if hybrid else vl_config(family)
    build_tiny_vl(config, seed).save_pretrained(out_dir)
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


def hf_row_logprobs(model, rows: Batch) -> torch.Tensor:
    """transformers' own forward of each row alone (its real tokens, its images): log p(next token) [B, L-1], zero
    where the row has no real token pair."""
    ids_BL, mask_BL = rows["input_ids"], rows["attention_mask"]
    out = torch.zeros(ids_BL.shape[0], ids_BL.shape[1] - 1)
    for b, entry in enumerate(rows.meta["multi_modal_inputs"]):
        cols = mask_BL[b].nonzero()[:, 0]
        ids_1L = ids_BL[b, cols][None]
        kwargs = {} if entry is None else dict(pixel_values=entry["pixel_values"], image_grid_thw=entry["image_grid_thw"],
                                                mm_token_type_ids=(ids_1L == IMAGE).int())
        logits = model(input_ids=ids_1L, use_cache=False, **kwargs).logits.float()[0]
        out[b, cols[:-1]] = torch.log_softmax(logits[:-1], -1).gather(-1, ids_1L[0, 1:, None])[:, 0]
    return out


def hf_image_kwargs(rows: Batch) -> dict:
    """The padded rows' images as transformers' forward takes them (none for text-only rows)."""
    ids = rows["input_ids"]
    entries = [e for e in rows.meta["multi_modal_inputs"] if e is not None]
    if not entries:
        return {}
    return dict(pixel_values=torch.cat([e["pixel_values"] for e in entries]),
                image_grid_thw=torch.cat([e["image_grid_thw"] for e in entries]), mm_token_type_ids=(ids == IMAGE).int())


def reference_pair(family: str):
    """(transformers' model of `family` with sdpa attention, rlsp's causal LM with the same weights, config)."""
    from transformers import AutoModelForImageTextToText  # noqa: PLC0415

    from rlsp.models.loading import build_causal_lm_from_config  # noqa: PLC0415

    config = vl_config(family)
    torch.manual_seed(0)
    ref = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa")
    lm = build_causal_lm_from_config(config)
    lm.load_state_dict(ref.state_dict())
    return ref, lm, config


def hf_logprobs(model, rows: Batch) -> torch.Tensor:
    """transformers' own forward of the padded rows: log p(next token) [B, L-1] (meaningless where masked)."""
    ids, mask = rows["input_ids"], rows["attention_mask"]
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False, **hf_image_kwargs(rows)).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
