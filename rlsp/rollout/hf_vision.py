"""Vision-language prompts in the hf rollout engine (rlsp.rollout.hf_engine): the model, the images and the positions.

A vision-language checkpoint (rlsp.models.vision_inputs.VISION_FAMILIES) is loaded with its vision tower
(`AutoModelForImageTextToText`, the class the trainer loads); so is a Qwen3.5 wrapper (TOWER_OPTIONAL) when the run's
rows carry images (`vision_tower`, rlsp.data.vision_run), its hybrid layers decoding over the model's own cache
(keys and values of the gated attention layers, conv and recurrent state of the Gated DeltaNet ones). A prompt's
images are its row's processor outputs (`multi_modal_inputs`: pixel values and grids, the same the trainer reads),
repeated for each of its samples; the prefill hands them to the model's own forward (vision tower, placeholder
scatter, Qwen3-VL's deepstack) with the multimodal rope positions of the left-padded prompts from the model's own
`get_rope_index`. Decoding continues every row's text positions after the largest position of its prompt, which is
how the model itself continues (its rope deltas), so the sampled tokens' logprobs are the trainer's.

Legend: N rows (prompts x samples), P padded prompt width.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PreTrainedModel

from rlsp.models.vision_inputs import TOWER_FAMILIES, VISION_FAMILIES, attn_implementation_for
from rlsp.rollout.hf_vision_turns import image_positions


def load_generation_model(model_path: str, config: Any, dtype: torch.dtype, attn: str | None,
                          vision_tower: bool = False) -> PreTrainedModel:
    """The model the engine decodes with: a vision-language family (a Qwen3.5 wrapper with `vision_tower`) with its
    vision tower, else the causal LM."""
    model_type = getattr(config, "model_type", None)
    if vision_tower and model_type not in TOWER_FAMILIES:
        raise ValueError(f"vision_tower=True: {model_type} has no vision tower rlsp loads; legal: {list(TOWER_FAMILIES)}")
    if model_type in VISION_FAMILIES or vision_tower:  # the trainer's per-sub-config attention choice
        impl = attn_implementation_for(config, attn or "sdpa")
        return AutoModelForImageTextToText.from_pretrained(model_path, dtype=dtype, attn_implementation=impl)
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=attn)


def check_image_rows(model: PreTrainedModel, images: Sequence[Any], prompts: int) -> None:
    """Raise ValueError unless `images` (one entry per prompt, None for a prompt without images) suits the model."""
    if len(images) != prompts:
        raise ValueError(f"{len(images)} image entries for {prompts} prompts; one per prompt (None: no image)")
    if getattr(model.config, "model_type", None) not in TOWER_FAMILIES:
        raise ValueError(f"prompts carry images but the rollout model is a {model.config.model_type} (text-only); "
                         f"images need a vision-language model: {list(TOWER_FAMILIES)} (qwen3_5 / qwen3_5_moe loaded "
                         "with vision_tower=True)")


def prefill_inputs(model: PreTrainedModel, input_ids_NP: torch.Tensor, mask_NP: torch.Tensor,
                   entries_N: Sequence[Any]) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """(the prefill's image kwargs, its positions [3, N, P], every row's next text position [N, 1]) for rows whose
    images are `entries_N` (None: a row without images)."""
    device = input_ids_NP.device
    with_images = [e for e in entries_N if e is not None]
    kwargs: dict[str, torch.Tensor] = {}
    grid = None
    if with_images:
        dtype = model.get_input_embeddings().weight.dtype
        kwargs["pixel_values"] = torch.cat([e["pixel_values"] for e in with_images]).to(device=device, dtype=dtype)
        grid = torch.cat([e["image_grid_thw"] for e in with_images]).to(device)
        kwargs["image_grid_thw"] = grid
    image_NP = image_positions(model, input_ids_NP, mask_NP, entries_N)  # the prompts' images (rlsp.rollout.hf_vision_turns)
    if with_images and not torch.equal(image_NP, input_ids_NP == model.config.image_token_id):
        kwargs["image_mask"] = image_NP  # later image-token ids are text: the engine prefills with embedded_prefill
    types_NP = image_NP.int()
    positions_3NP, _ = model.model.get_rope_index(input_ids_NP, mm_token_type_ids=types_NP, image_grid_thw=grid,
                                                  attention_mask=mask_NP)
    positions_3NP = positions_3NP.to(device)
    real_3NP = positions_3NP.masked_fill(~mask_NP.bool()[None], -1)
    next_N1 = real_3NP.amax(dim=(0, 2)).unsqueeze(-1) + 1
    return kwargs, positions_3NP, next_N1


def repeat_entries(images: Sequence[Any], n: int) -> list[Any]:
    """Each prompt's entry once per sample (rows of a prompt are contiguous)."""
    return [entry for entry in images for _ in range(n)]
