"""The image tokens of a dataset's rows, counted from the images' sizes alone: what the `auto` checkpointing rule
needs (rlsp.config.auto_vision) before anything is rendered.

`train_image_tokens(cfg)` reads the image column (verl's `images`, rlsp.data.multimodal.IMAGE_KEY) of
data.train_files batch by batch, opens each image only as far as its size (PIL reads the header, no pixels are
decoded) and asks the model's processor how many placeholder tokens an image of that size expands into
(`_get_num_multimodal_tokens`, the count behind the processor's own `<|image_pad|>` expansion; equal to what
rlsp.check reports per row, tested): no pixel processing, no model weights. It returns the largest row's sum; 0 when
no file has images; None when it cannot count here: not a vision-language model directory (none, or a `builtin://`
path not resolved yet), a file that is not a local parquet file, an image it cannot read, no processor (the preflight
checks name each of those).
"""

from __future__ import annotations

import functools
import io
import json
import os
from collections.abc import Sequence
from typing import Any

from rlsp.data.multimodal import IMAGE_KEY, Where, _image_bytes
from rlsp.data.vision_processor import load_processor

MODEL_KEY = "actor_rollout_ref.model.path"
BATCH_ROWS = 256  # rows read at a time: the image column is never held whole


def _is_vision_model(path: str) -> bool:
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return False
    with open(file) as f:
        return "vision_config" in json.load(f)


def _image_size(value: Any, base_dir: str, where: Where, i: int) -> list[int]:
    """[height, width] of one image of a row, from its header."""
    from PIL import Image  # noqa: PLC0415

    with Image.open(io.BytesIO(_image_bytes(value, base_dir, where, i))) as image:
        return [image.height, image.width]


def _file_rows(path: str, model_path: str) -> int:
    """The most image tokens one row of parquet `path` holds (0: none); the processor is read at the first image."""
    import pyarrow.parquet as pq  # noqa: PLC0415

    parquet = pq.ParquetFile(path)
    if IMAGE_KEY not in parquet.schema_arrow.names:
        return 0
    base_dir, most, row = os.path.dirname(os.path.abspath(path)), 0, 0
    for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=[IMAGE_KEY]):
        for images in batch.column(0).to_pylist():
            sizes = [_image_size(v, base_dir, Where(path, row), i) for i, v in enumerate(images or [])]
            if sizes:
                counts = load_processor(MODEL_KEY, model_path)._get_num_multimodal_tokens(image_sizes=sizes)
                most = max(most, sum(counts.num_image_tokens))
            row += 1
    return most


@functools.lru_cache(maxsize=8)
def _count(model_path: str, model_mtime: float, files: tuple[tuple[str, float], ...]) -> int:
    return max((_file_rows(path, model_path) for path, _ in files), default=0)


def largest_row_image_tokens(model_path: str, files: Sequence[str]) -> int | None:
    """The most image tokens one row of parquet `files` holds, for the model at `model_path` (see the module
    docstring; None: not countable here)."""
    if not (isinstance(model_path, str) and _is_vision_model(model_path)):
        return None
    if not all(str(f).endswith(".parquet") and os.path.isfile(f) for f in files):
        return None
    stamped = tuple((os.path.abspath(f), os.path.getmtime(f)) for f in files)
    try:
        return _count(os.path.abspath(model_path), os.path.getmtime(model_path), stamped)
    except (ValueError, OSError, TypeError, AttributeError, KeyError):  # the preflight checks name the problem
        return None


def train_image_tokens(cfg: Any) -> int | None:
    """`largest_row_image_tokens` of the run's model and data.train_files (None: not countable here)."""
    files, path = cfg.data.train_files, cfg.actor_rollout_ref.model.path
    if isinstance(files, str):  # a str or a list (verl's forms); anything else is the config stage's to name
        files = [files]
    if not (isinstance(path, str) and isinstance(files, Sequence) and all(isinstance(f, str) for f in files)):
        return None
    return largest_row_image_tokens(path, list(files))
