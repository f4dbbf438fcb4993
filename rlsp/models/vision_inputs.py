"""The images of one packed micro-batch, laid out on its token stream, and their multimodal rope positions.

Rows carry their images in `Batch.meta["multi_modal_inputs"]` (`MM_KEY`): per row None (no image) or
{"pixel_values": [patches, C*T*P*P] float, "image_grid_thw": [images, 3] long} as the model's image processor returns
them, with the expanded image placeholder tokens already in the row's `input_ids`. `stream_images` collects the
images of the rows that reach the packed stream (in stream order) and checks every row's placeholder count against
its grids; `rope_positions` gives the stream's 3-D (temporal, height, width) rope positions, each row's from the
model's own `get_rope_index` on its real tokens, text-only rows and the padding tail the 1-D positions repeated
(what the model gives them: equal sections make multimodal rope the plain one).

Legend: T packed stream, N images, Np patches of an image, F pixel values per patch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlsp.data.packing import PackedBatch

MM_KEY = "multi_modal_inputs"
# Vision-language families rlsp trains with their vision tower (rlsp.models.vision_lm); the tower keeps its own
# attention (VISION_ATTN_IMPL), the text model runs rlsp_ulysses.
VISION_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
# Qwen3.5 wrappers (hybrid Gated DeltaNet text models): text-only unless loaded with their tower (`load_causal_lm(...,
# vision_tower=True)`); then rlsp.models.vision_lm trains them with images like VISION_FAMILIES.
TOWER_OPTIONAL = ("qwen3_5", "qwen3_5_moe")
TOWER_FAMILIES = (*VISION_FAMILIES, *TOWER_OPTIONAL)  # what VisionLogprobModel wraps
VISION_TEXT_TYPES = ("qwen2_5_vl_text", "qwen3_vl_text", "qwen3_vl_moe_text")  # their text configs (what read_model_config returns)
VISION_ATTN_IMPL = "sdpa"
# HF names of the input embedding that a tied output layer (`lm_head.weight`) shares: a text causal LM's, and a
# vision-language model's text model's (transformers' module tree, what the trainer's weight sync sends).
TIED_EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
ENTRY_KEYS = ("pixel_values", "image_grid_thw")


def attn_implementation_for(config: Any, attn_implementation: str) -> str | dict[str, str]:
    """What to pass as `attn_implementation` when building a model of `config`: per sub-config for a vision-language
    family (the text model's the given one, the vision tower's its own), else `attn_implementation` itself."""
    if getattr(config, "model_type", None) not in TOWER_FAMILIES:
        return attn_implementation
    return {"text_config": attn_implementation, "vision_config": VISION_ATTN_IMPL, "": VISION_ATTN_IMPL}


@dataclass
class MultiModalRows:
    """What the engine hands a head model with a micro-batch whose rows carry `MM_KEY`: the rows' entries and the
    packed stream (the model turns them into `StreamImages` with its own image token and merge size)."""

    entries: list[Any]
    packed: PackedBatch
    prompt_len: int | None = None  # the rows' padded prompt width: image tokens are the prompt's (None: anywhere)


@dataclass
class StreamImages:
    """The images of a packed micro-batch: per image its pixel rows and grid, in stream order."""

    input_ids_T: torch.Tensor  # the packed stream's token ids
    image_mask_T: torch.Tensor  # where the images' tokens are: the image token inside a prompt (a sampled one is text)
    position_ids_T: torch.Tensor  # its 1-D positions (restarting at every row)
    seq_lens: list[int]  # per row, in stream order (0: an empty row)
    images_per_row: list[int]
    pixel_values: list[torch.Tensor]  # per image [Np, F]
    grid_thw_N3: torch.Tensor  # [N, 3] long


def _check_entry(row: int, entry: Any) -> dict[str, torch.Tensor] | None:
    if entry is None:
        return None
    if not isinstance(entry, dict) or set(entry) != set(ENTRY_KEYS):
        keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise ValueError(f"{MM_KEY}[{row}] has {keys}; legal: None or a dict with exactly {list(ENTRY_KEYS)} "
                         "(images only: videos are not supported)")
    grid = entry["image_grid_thw"]
    if grid.dim() != 2 or grid.shape[1] != 3 or int(entry["pixel_values"].shape[0]) != int(grid.prod(-1).sum()):
        raise ValueError(f"{MM_KEY}[{row}]: pixel_values {tuple(entry['pixel_values'].shape)} and image_grid_thw "
                         f"{tuple(grid.shape)} disagree: the rows must number sum(t*h*w) of the [images, 3] grids")
    return entry


def image_token_mask(packed: PackedBatch, token_id: int, prompt_len: int | None) -> torch.Tensor:
    """[T] where the stream holds `token_id` inside a row's prompt (columns < prompt_len; None: anywhere). A response
    may sample the image token: it is text there, as it is to the rollout engine that sampled it."""
    mask_T = packed.input_ids == token_id
    if prompt_len is not None:
        real = len(packed.col_index)
        mask_T[:real] &= packed.col_index.to(mask_T.device) < prompt_len
        mask_T[real:] = False
    return mask_T


def stream_images(entries: list[Any] | None, packed: PackedBatch, image_token_id: int,
                  merge: int, prompt_len: int | None = None) -> StreamImages | None:
    """The images of the rows that reach the stream (rows without tokens drop theirs), or None without any image;
    image tokens are counted inside the prompts (`prompt_len`, see `image_token_mask`)."""
    if entries is None:
        return None
    if len(entries) != len(packed.seq_lens):
        raise ValueError(f"{MM_KEY} has {len(entries)} entries for {len(packed.seq_lens)} rows")
    image_mask_T = image_token_mask(packed, image_token_id, prompt_len)
    pixels, grids, per_row, start = [], [], [], 0
    for row, (entry, n_tok) in enumerate(zip(entries, packed.seq_lens)):
        entry = _check_entry(row, entry) if n_tok else None
        grid = entry["image_grid_thw"].long() if entry is not None else torch.zeros(0, 3, dtype=torch.long)
        want, have = int((grid.prod(-1) // merge**2).sum()), int(image_mask_T[start:start + n_tok].sum())
        if want != have:
            raise ValueError(f"row {row} holds {have} image tokens (id {image_token_id}) but its image_grid_thw "
                             f"{grid.tolist()} needs {want} (t*h*w / {merge}^2 per image)")
        if entry is not None:
            sizes = grid.prod(-1).tolist()
            pixels += list(torch.split(entry["pixel_values"], sizes))
            grids.append(grid)
        per_row.append(len(grid))
        start += n_tok
    if not pixels:
        return None
    return StreamImages(packed.input_ids, image_mask_T, packed.position_ids, list(packed.seq_lens), per_row, pixels,
                        torch.cat(grids))


def rope_positions(vl_model: Any, images: StreamImages) -> torch.Tensor:
    """[3, T] rope positions of the stream: each row with images from `vl_model.get_rope_index` (the HF
    vision-language base model) on its real tokens, every other token its 1-D position in all three sections."""
    positions_3T = images.position_ids_T.expand(3, -1).clone()
    start, first = 0, 0
    for n_tok, n_img in zip(images.seq_lens, images.images_per_row):
        if n_img:
            ids_1L = images.input_ids_T[start:start + n_tok][None]
            types_1L = images.image_mask_T[start:start + n_tok][None].int()
            pos_31L, _ = vl_model.get_rope_index(ids_1L, mm_token_type_ids=types_1L,
                                                 image_grid_thw=images.grid_thw_N3[first:first + n_img])
            positions_3T[:, start:start + n_tok] = pos_31L[:, 0].to(positions_3T)
        start, first = start + n_tok, first + n_img
    return positions_3T
