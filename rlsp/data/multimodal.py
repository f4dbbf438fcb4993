"""Image rows of verl's multimodal layout, rendered with the model's own processor.

A row carries its chat prompt with `<image>` placeholders and an image column (`IMAGE_KEY`, verl's
`data.image_key` default "images"): a list per row of images, each a dict with "bytes" (how parquet stores a
PIL image; a "path" beside it is used when the bytes are missing), raw bytes, or a file path (relative to the
parquet file). `vision_prompt` decodes the images with PIL, checks them (unreadable, zero-sized, placeholder
count != image count: ValueError naming file, row, key and what is legal), turns each placeholder into an image
content part, renders the messages with the processor's chat template and runs the processor, which expands
every image's placeholder into `<|vision_start|><|image_pad|>*n<|vision_end|>` (n = grid_t*grid_h*grid_w /
merge_size^2) and returns the pixel values and grid sizes.

What a row carries (the model side consumes exactly this): `prompt_ids` with the placeholders expanded,
`prompt_text` the rendered template before expansion (what a rollout engine taking raw images is given with
`images`), `multi_modal_inputs` None without images, else {"pixel_values": float [patches, C*T*P*P],
"image_grid_thw": long [n_images, 3]} as the processor returns them, and `images` the raw bytes of each image.
In a Batch they travel as `meta["multi_modal_inputs"]` and `meta["images"]` (`multimodal_meta`).

Video columns (`VIDEO_KEY`) are refused by name where the processor cannot take videos (no torchvision).
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlsp.data.vision_processor import VIDEO_NEEDS_TORCHVISION, has_torchvision, load_processor

IMAGE_KEY = "images"  # verl's data.image_key default
VIDEO_KEY = "videos"  # verl's data.video_key default
IMAGE_PLACEHOLDER = "<image>"
IMAGE_PROBLEM = "data.image_key="  # how every "this model cannot read the images" problem starts
VIDEO_PLACEHOLDER = "<video>"
SOURCE_COLUMN = "__rlsp_source_file"  # set by the dataset reader on image rows: relative image paths resolve from it
IMAGE_FORMS = ("a dict with 'bytes' (parquet's image struct) or 'path'", "raw bytes", "a path relative to the file")


@dataclass(frozen=True)
class Where:
    """Where a row lives, for error messages: the file, the row index and the image column."""

    file: str
    row: int
    key: str = IMAGE_KEY

    def __str__(self) -> str:
        return f"{self.file} row {self.row} column {self.key!r}"


def has_values(column: Sequence[Any]) -> bool:
    """Whether any row of a frame column holds a non-empty list (a None / empty list is a row without media)."""
    return any(v is not None and not _is_nan(v) and len(v) > 0 for v in column)


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and value != value


def refuse_video(file: str) -> None:
    """Rows with videos: ValueError naming the file and key (no torchvision here, or video not wired in yet)."""
    why = VIDEO_NEEDS_TORCHVISION if not has_torchvision() else ("rlsp reads images only so far; legal: rows with "
                                                                  "images only")
    raise ValueError(f"{file}: column {VIDEO_KEY!r} (data.video_key) holds videos; {why}")


def dataset_processor(frame: Any, tokenizer: Any, processor: Any = None) -> Any:
    """The processor a frame's rows render with: None for a frame without images (text rows, rendered with the
    tokenizer as before), else `processor` or the one of the tokenizer's model directory (load_processor)."""
    if VIDEO_KEY in frame.columns and has_values(frame[VIDEO_KEY]):
        with_video = [has_values([v]) for v in frame[VIDEO_KEY]]
        refuse_video(str(frame[SOURCE_COLUMN][with_video.index(True)]))
    if IMAGE_KEY not in frame.columns or not has_values(frame[IMAGE_KEY]):
        return None
    if processor is not None:
        return processor
    try:
        return load_processor("actor_rollout_ref.model.path", str(getattr(tokenizer, "name_or_path", "")))
    except ValueError as exc:  # the preflight check `vision_data` says the same of the model: one prefix for both
        file = frame[SOURCE_COLUMN][[has_values([v]) for v in frame[IMAGE_KEY]].index(True)]
        raise ValueError(f"{IMAGE_PROBLEM}{IMAGE_KEY!r}: {file} has images; {exc}") from None


def _image_bytes(value: Any, base_dir: str, where: Where, i: int) -> bytes:
    if isinstance(value, Mapping):
        if value.get("bytes"):
            return bytes(value["bytes"])
        if not value.get("path"):
            raise ValueError(f"{where} image {i}: empty (no bytes, no path); legal image forms: {', '.join(IMAGE_FORMS)}")
        value = value["path"]
    if isinstance(value, bytes | bytearray):
        if not value:
            raise ValueError(f"{where} image {i}: empty (0 bytes); legal image forms: {', '.join(IMAGE_FORMS)}")
        return bytes(value)
    if isinstance(value, str) and value:
        path = value if os.path.isabs(value) else os.path.join(base_dir, value)
        if not os.path.isfile(path):
            raise ValueError(f"{where} image {i}: file {path!r} not found; legal image forms: {', '.join(IMAGE_FORMS)}")
        with open(path, "rb") as f:
            return f.read()
    raise ValueError(f"{where} image {i}: {type(value).__name__} {str(value)[:60]!r} is no image; legal image forms: "
                     f"{', '.join(IMAGE_FORMS)}")


def decode_images(values: Any, base_dir: str, where: Where) -> tuple[list[Any], list[bytes]]:
    """The row's images as PIL images, and their bytes; ValueError for an unreadable or zero-sized image."""
    from PIL import Image, UnidentifiedImageError  # noqa: PLC0415

    if values is None or _is_nan(values):
        return [], []
    if not isinstance(values, list | tuple):
        raise ValueError(f"{where}: {type(values).__name__} is not a list of images; legal: a list (one entry per "
                         f"{IMAGE_PLACEHOLDER} placeholder) of {', '.join(IMAGE_FORMS)}")
    images, raw = [], []
    for i, value in enumerate(values):
        data = _image_bytes(value, base_dir, where, i)
        try:
            image = Image.open(io.BytesIO(data))
            image.load()
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise ValueError(f"{where} image {i}: unreadable ({len(data)} bytes; {exc}); legal: an image file PIL "
                             "decodes (png, jpeg, ...)") from None
        if image.width < 1 or image.height < 1:  # PIL refuses most such files when opening them; a plugin may not
            raise ValueError(f"{where} image {i}: zero-sized ({image.width}x{image.height}); legal: at least 1x1")
        images.append(image)
        raw.append(data)
    return images, raw


def _split_text(text: str) -> list[dict[str, str]]:
    parts: list[dict[str, str]] = []
    for k, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if k:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def content_parts(messages: list[dict[str, Any]], n_images: int, where: Where) -> list[dict[str, Any]]:
    """`messages` with every `<image>` placeholder of a string content turned into an image content part; a
    ValueError when the placeholders (and image parts already present) do not match the row's images one to one."""
    out, found = [], 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            if VIDEO_PLACEHOLDER in content:
                raise ValueError(f"{where}: the prompt has a {VIDEO_PLACEHOLDER} placeholder; {VIDEO_NEEDS_TORCHVISION}")
            found += content.count(IMAGE_PLACEHOLDER)
            message = {**message, "content": _split_text(content)} if IMAGE_PLACEHOLDER in content else message
        elif isinstance(content, list):
            found += sum(isinstance(p, Mapping) and p.get("type") == "image" for p in content)
        out.append(message)
    if found != n_images:
        raise ValueError(f"{where}: the prompt has {found} {IMAGE_PLACEHOLDER} placeholder(s) and the row {n_images} "
                         f"image(s); legal: one {IMAGE_PLACEHOLDER} per image, in the order of the list")
    return out


def vision_prompt(messages: list[dict[str, Any]], images: Sequence[Any], processor: Any, where: Where,
                  tools: list[dict[str, Any]] | None = None,
                  template_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Render and process one row: prompt_text (template, placeholders not expanded), prompt_ids (expanded) and
    multi_modal_inputs (None without images)."""
    parts = content_parts(messages, len(images), where)
    text = processor.apply_chat_template(parts, tools=tools or None, tokenize=False, add_generation_prompt=True,
                                         **(template_kwargs or {}))
    out = processor(text=[text], images=list(images) or None, return_tensors="pt")
    mm = None
    if images:
        mm = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    return {"prompt_text": text, "prompt_ids": out["input_ids"][0].tolist(), "multi_modal_inputs": mm}


def image_token_count(ids: Sequence[int], processor: Any) -> int:
    """How many of `ids` are image placeholder tokens (`<|image_pad|>` of Qwen-VL)."""
    token = processor.image_token_id
    return sum(i == token for i in ids)


def vision_item(row: dict[str, Any], row_index: int, messages: list[dict[str, Any]] | None, processor: Any,
                tools: list[dict[str, Any]] | None = None,
                template_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The rendered fields of a dataset row of a file with images (see the module docstring); `messages` None is a
    completion prompt (data.apply_chat_template=false), which cannot place images."""
    file = str(row.get(SOURCE_COLUMN) or ".")
    where = Where(file, row_index)
    if messages is None:
        raise ValueError(f"{where}: a prompt with images needs data.apply_chat_template=true (the processor's chat "
                         f"template places the {IMAGE_PLACEHOLDER} placeholders); got a completion prompt")
    images, raw = decode_images(row.get(IMAGE_KEY), os.path.dirname(os.path.abspath(file)), where)
    item = vision_prompt(messages, images, processor, where, tools, template_kwargs)
    item["images"] = raw
    item["image_tokens"] = image_token_count(item["prompt_ids"], processor)
    return item


def check_truncation(before: Sequence[int], after: Sequence[int], processor: Any, row_index: int) -> None:
    """A cut prompt must keep every image token (the images' features fill exactly those positions)."""
    kept, had = image_token_count(after, processor), image_token_count(before, processor)
    if kept != had:
        raise ValueError(f"row {row_index}: truncating its {len(before)} prompt tokens to {len(after)} cuts {had - kept}"
                         f" of its {had} image tokens; legal: data.filter_overlong_prompts=true or a larger "
                         "data.max_prompt_length")


def multimodal_meta(items: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """Batch meta fields of dataset items: `multi_modal_inputs` and `images` (one entry per row; {} for a
    text-only dataset, whose items carry neither)."""
    if not any("multi_modal_inputs" in it for it in items):
        return {}
    return {"multi_modal_inputs": [it.get("multi_modal_inputs") for it in items],
            "images": [it.get("images") or [] for it in items]}


def image_tokens_line(split: str, image_tokens: Sequence[int]) -> list[str]:
    """rlsp.check's line on a split's image rows (none for a split without images)."""
    shown = [n for n in image_tokens if n]
    if not shown:
        return []
    return [f"{split}: {len(shown)} rows with images; image tokens per row min/mean/max {min(shown)}/"
            f"{sum(shown) / len(shown):.1f}/{max(shown)} (counted in the prompt lengths)"]


def new_image_problems(found: Sequence[str], reported: Sequence[str]) -> list[str]:
    """`found` without its "the model cannot read images" problems when `reported` already has one (preflight's
    `vision_data` check names the model; the data report would repeat it per file)."""
    if any(p.startswith(IMAGE_PROBLEM) for p in reported):
        return [p for p in found if not p.startswith(IMAGE_PROBLEM)]
    return list(found)
