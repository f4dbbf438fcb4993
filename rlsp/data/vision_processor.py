"""The processor of a vision-language model directory: tokenizer + image processor + chat template.

`load_processor(key, path)` returns what `AutoProcessor.from_pretrained(path)` returns when that works. On an
install without torchvision, transformers cannot build Qwen-VL processors at all (their video processor needs
it, and the processor checks every sub-processor's class); the images need none of it (the PIL image processor,
numpy only). There the same processor class is loaded without its video part (`_image_only`): the same
`__call__`, placeholder expansion and chat template, read from the same files. Such a processor takes images
only; rows with videos are refused by name (rlsp.data.multimodal).

The preflight checks of data with images live here too: the model can read them (`vision_data_errors`), verl's
data.image_patch_size is the processor's patch size (`image_patch_size_errors`), the rollout engine takes them
(`image_run_errors`).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

# A processor's own files beside the model's (saved with a checkpoint's model files, so an export loads it again).
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.json", "chat_template.jinja")
VIDEO_NEEDS_TORCHVISION = ("video frames need the model's video processor, which needs torchvision, and this "
                           "install has none (the CPU torch wheel pairs with no torchvision build here); legal: "
                           "rows with images only, or an install with torchvision")


def has_torchvision() -> bool:
    """Whether torchvision imports (transformers' video processors need it)."""
    try:
        import torchvision  # noqa: F401, PLC0415
    except (ImportError, RuntimeError):  # RuntimeError: a build that does not match torch
        return False
    return True


def _processor_class_name(path: str) -> str | None:
    """The processor class a model directory names (processor_config.json / preprocessor_config.json), else the
    class transformers maps its model_type to."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file) as f:
                found = json.load(f).get("processor_class")
            if found:
                return str(found)
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES  # noqa: PLC0415

    with open(os.path.join(path, "config.json")) as f:
        return PROCESSOR_MAPPING_NAMES.get(json.load(f).get("model_type"))


@functools.lru_cache(maxsize=8)
def _image_only(class_name: str) -> type:
    """`class_name` (a transformers processor with a video processor) without its video processor."""
    import transformers  # noqa: PLC0415

    base = getattr(transformers, class_name)

    def __init__(self: Any, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                 **kwargs: Any) -> None:
        base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    # The processor's sub-processors are the modality arguments of its __init__ (ProcessorMixin.get_attributes).
    return type(f"{class_name}ImageOnly", (base,), {"__init__": __init__})


def load_processor(key: str, path: str) -> Any:
    """The processor of model directory `path` (config key `key`), with an image processor; ValueError naming the
    key, the path and what is missing when it has none (a text-only model, or no preprocessor_config.json)."""
    if not os.path.isfile(os.path.join(path, "preprocessor_config.json")):
        raise ValueError(f"{key}={path!r} has no preprocessor_config.json: no image processor to read images with; "
                         "legal: a vision-language model directory (e.g. qwen2_5_vl, qwen3_vl) with its processor "
                         "files")
    return _load(os.path.abspath(path), os.path.getmtime(path), key)


@functools.lru_cache(maxsize=4)
def _load(path: str, mtime: float, key: str) -> Any:
    from transformers import AutoProcessor  # noqa: PLC0415

    try:
        processor = AutoProcessor.from_pretrained(path)
    except ImportError as exc:
        if "torchvision" not in str(exc).lower():
            raise
        name = _processor_class_name(path)
        if name is None:
            raise ValueError(f"{key}={path!r}: no processor class is named in its files or known for its "
                             f"model_type, and AutoProcessor failed ({exc})") from None
        processor = _image_only(name).from_pretrained(path)
    if getattr(processor, "image_processor", None) is None:
        raise ValueError(f"{key}={path!r}: AutoProcessor gives a {type(processor).__name__} without an image "
                         "processor; legal: a vision-language model directory (e.g. qwen2_5_vl, qwen3_vl)")
    return processor



def image_rows(file: str, column: str) -> int:
    """Rows of parquet `file` whose `column` holds a non-empty list (0 when the file has no such column)."""
    import pyarrow.parquet as pq  # noqa: PLC0415 -- only this check reads columns

    if not (file.endswith(".parquet") and os.path.isfile(file)) or column not in pq.ParquetFile(file).schema_arrow.names:
        return 0
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.compute as pc  # noqa: PLC0415

    values = pq.read_table(file, columns=[column]).column(column)
    if not pa.types.is_list(values.type) and not pa.types.is_large_list(values.type):
        return 0  # all null (or not a list column: the dataset reader names that row by row)
    lengths = pc.fill_null(pc.list_value_length(values), 0)  # never the image bytes in Python
    return int(pc.sum(pc.greater(lengths, 0)).as_py() or 0)


def vision_data_errors(model_key: str, model_path: str, files: list[str], image_key: str = "images",
                       video_key: str = "videos") -> list[str]:
    """Problems of data `files` with images or videos for the model at `model_path`: videos without torchvision,
    images for a text-only model (no vision_config) or a model directory without an image processor."""
    errors = [f"data.video_key={video_key!r}: {file} has videos in {n} rows; {VIDEO_NEEDS_TORCHVISION}"
              for file in files if (n := image_rows(file, video_key)) and not has_torchvision()]
    with_images = [(file, n) for file in files if (n := image_rows(file, image_key))]
    if not with_images:
        return errors
    file, n = with_images[0]
    with open(os.path.join(model_path, "config.json")) as f:
        config = json.load(f)
    if "vision_config" not in config:
        return [*errors, f"data.image_key={image_key!r}: {file} has images in {n} rows, and {model_key}="
                f"{model_path!r} is a {config.get('model_type')} text-only model (no vision tower); legal: a "
                "vision-language model with its processor (e.g. qwen2_5_vl, qwen3_vl), or data without images"]
    try:
        load_processor(model_key, model_path)
    except (ValueError, OSError) as exc:
        errors.append(f"data.image_key={image_key!r}: {file} has images in {n} rows; {exc}")
    return errors


def image_patch_size_errors(value: int | None, model_key: str, model_path: str, files: list[str],
                            image_key: str = "images") -> list[str]:
    """data.image_patch_size=`value` against the patch size of the model's processor (what verl 0.9 defaults it to
    and rolls out with; rlsp resizes every image with it): null or equal is verl's result, another value is refused
    when `files` have rows with images. Without images the key changes nothing; a model that cannot read the images
    is named by `vision_data_errors`."""
    if value is None:
        return []
    with_images = [(file, n) for file in files if (n := image_rows(file, image_key))]
    if not with_images:
        return []
    try:
        processor = load_processor(model_key, model_path)
    except (ValueError, OSError):
        return []  # vision_data_errors names the model that has no processor
    patch = getattr(processor.image_processor, "patch_size", None)
    if value == patch:
        return []
    file, n = with_images[0]
    return [f"data.image_patch_size={value!r}: {file} has images in {n} rows, and the processor of {model_key}="
            f"{model_path!r} resizes them with patch_size={patch!r}; verl 0.9 would count their prompt lengths with "
            f"{value!r} while rolling out with {patch!r}, and rlsp reads every image with the processor's; legal "
            f"values: null or {patch!r}"]


def image_run_errors(cfg: Any) -> list[str]:
    """What a run over rows with images cannot do (yet), by key: rollouts other than the hf engine's. Agent loops
    (every turn generated with the prompt's images) and partial rollouts (every continued segment too) take them
    (rlsp.rollout.hf_vision_turns)."""
    r, errors = cfg.actor_rollout_ref.rollout, []
    if r.name != "hf":
        errors.append(f"actor_rollout_ref.rollout.name={r.name!r}: prompts with images roll out with the hf engine "
                      "(rlsp.rollout.hf_vision); legal: hf")
    return errors
