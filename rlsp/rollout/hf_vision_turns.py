"""Continued vision-language prompts in the hf rollout engine: which image-token ids are the images', and the prefill
of a continuation whose later tokens hold more of them.

A multi-turn trajectory (rlsp.agent) or a partial rollout's next segment (rlsp.rollout.segments) asks the engine to
continue prompt + tokens so far, with the prompt's images. Its image tokens are the first K image-token ids of the
row, K = sum(t*h*w) / merge^2 over the row's grids: the prompt's, which come first. An image-token id the policy
sampled or a tool's text rendered after them is text, as it was to the engine that produced it and as it is to the
trainer (rlsp.models.vision_inputs.image_token_mask counts image tokens inside the prompt only).

The model's own forward scatters the image features at every image-token id of its input, so a row holding more
of them than its images fill goes through `embedded_prefill` instead: the same vision tower, the features scattered
at the row's image positions only, the text model on those embeddings (with Qwen3-VL's deepstack features at the
same positions) and the output layer on the last position, which is what the model's forward computes.

Legend: N rows, P padded prompt width, V visual tokens of the batch, H text hidden size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel


def image_positions(model: PreTrainedModel, input_ids_NP: torch.Tensor, mask_NP: torch.Tensor,
                    entries_N: Sequence[Any]) -> torch.Tensor:
    """[N, P] bool: the first K image-token ids of every real row (K from its entry's grids, 0 for None); ValueError
    naming the row when it holds fewer than its images need (a continuation that lost part of its prompt)."""
    token, merge = model.config.image_token_id, model.config.vision_config.spatial_merge_size
    is_image_NP = (input_ids_NP == token) & mask_NP.bool()
    rank_NP = is_image_NP.long().cumsum(-1)  # 1 at a row's first image token, 2 at its second, ...
    need_N = torch.tensor([0 if e is None else int((e["image_grid_thw"].prod(-1) // merge**2).sum()) for e in entries_N],
                          dtype=torch.long, device=input_ids_NP.device)
    have_N = is_image_NP.sum(-1)
    short = (have_N < need_N).nonzero()[:, 0].tolist()
    if short:
        r = short[0]
        raise ValueError(f"row {r} holds {int(have_N[r])} image tokens (id {token}) but its images need "
                         f"{int(need_N[r])}: a continued prompt must start with its row's prompt, images included")
    return is_image_NP & (rank_NP <= need_N[:, None])


def embedded_prefill(model: PreTrainedModel, input_ids_NP: torch.Tensor, image_mask: torch.Tensor,
                     pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, **forward: Any) -> torch.Tensor:
    """Logits [N, vocab] of the last position of a prefill whose image features go to `image_mask` [N, P] only
    (`image_positions`); `forward`: the text model's attention_mask, position_ids, past_key_values and use_cache."""
    image_mask_NP = image_mask
    visual = model.model.visual
    out = visual(pixel_values.to(visual.dtype), grid_thw=image_grid_thw, return_dict=True)
    embeds_NPH = model.get_input_embeddings()(input_ids_NP)
    feats_VH = out.pooler_output.to(embeds_NPH.dtype)
    if feats_VH.shape[0] != int(image_mask_NP.sum()):
        raise ValueError(f"{feats_VH.shape[0]} visual tokens for {int(image_mask_NP.sum())} image positions")
    embeds_NPH = embeds_NPH.masked_scatter(image_mask_NP[..., None], feats_VH)
    deep = list(getattr(out, "deepstack_features", None) or [])
    if deep:  # Qwen3-VL: each level's features are added at the visual positions inside the first text layers
        forward["visual_pos_masks"] = image_mask_NP
        forward["deepstack_visual_embeds"] = [d.to(embeds_NPH.dtype) for d in deep]
    hidden_NPH = model.model.language_model(input_ids=None, inputs_embeds=embeds_NPH, **forward).last_hidden_state
    return model.lm_head(hidden_NPH[:, -1:])[:, -1]
