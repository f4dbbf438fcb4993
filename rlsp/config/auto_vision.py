"""The vision tower's activations in the `auto` checkpointing rule (rlsp.config.auto_memory): the image tokens per
training row and what the tower saves for backward for the images one micro-batch holds.

A vision-language actor (rlsp.config.vision_shape: a model_type of TEXT_EQUIVALENT) encodes its micro-batch's images
in the same forward as its text, and its tower saves what `tower_saved_bytes` counts for the image tokens on the
rank. How many image tokens a row holds:
  counted   the largest row's of data.train_files, read once at start-up from each image's size with the model's
            processor (rlsp.data.image_count: no pixels processed, no model weights loaded), at most
            data.max_prompt_length;
  bound     data.max_prompt_length when the data was not counted (a path that is not a local file yet, an unreadable
            image: the preflight checks name those): a row's image tokens are prompt tokens and are never cut (a longer
            row is dropped or refused), so no row holds more.
A micro-batch of `tokens` tokens over rows of up to seq_len = max_prompt_length + max_response_length tokens holds at
most tokens x row images / seq_len image tokens (every row as large as the largest), spread over the role's sequence
splits as rlsp.models.vision_lm spreads their patches: the planner's share (rlsp.plan.workload.Workload
.rank_image_tokens, with the stream and its shard both `tokens`). Rows without images (a count of 0) change nothing.
A vision-language critic (rlsp.models.critic_vision: its model is of the actor's family, loaded with its tower) encodes
the same rows' images in its forward and counts the same; a text critic's shape has no tower and counts none.

No torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlsp.config.model_shape import ModelShape
from rlsp.config.vision_shape import tower_saved_bytes


@dataclass(frozen=True)
class RowImages:
    """Image tokens of the largest training row (`tokens`) and where that number comes from (`source`)."""

    tokens: int
    source: str


def row_images(shape: ModelShape | None, counted: int | None, max_prompt_length: int) -> RowImages | None:
    """A role's image load (the actor's; a vision-language critic's): None for a model without a vision tower or data
    without images (`counted` 0); `counted` None: not counted, data.max_prompt_length bounds it."""
    if shape is None or shape.vision is None or counted == 0:
        return None
    if counted is None:
        return RowImages(max_prompt_length, f"up to data.max_prompt_length={max_prompt_length} image tokens a row "
                                            "(the data's were not counted)")
    n = min(counted, max_prompt_length)
    return RowImages(n, f"{n} image tokens in the largest row of data.train_files")


def rank_image_tokens(images: RowImages, tokens: int, seq_len: int, splits: int) -> int:
    """Image tokens whose patches one rank encodes: its share of a micro-batch of `tokens` tokens whose rows of
    `seq_len` tokens each hold `images.tokens` of them, over `splits` sequence splits."""
    return -(-tokens * min(images.tokens, seq_len) // (seq_len * splits))


def image_saved_bytes(shape: ModelShape, images: RowImages | None, tokens: int, seq_len: int, dtype_bytes: int,
                      splits: int = 1) -> tuple[int, float]:
    """(image tokens on the rank, bytes the tower saves for them without checkpointing); (0, 0.0) without images."""
    if images is None or shape.vision is None or seq_len < 1:
        return 0, 0.0
    rank = rank_image_tokens(images, tokens, seq_len, splits)
    return rank, tower_saved_bytes(shape.vision, rank, dtype_bytes)
