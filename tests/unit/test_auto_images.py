"""The `auto` checkpointing rule counts a vision-language actor's image activations (rlsp.config.auto_vision).

The data's image tokens per row are counted from the images' sizes (rlsp.data.image_count) and equal what the
processor's own rendering gives row by row (rlsp.check's count); with them the rule adds the tower's saved
activations, the planner's term (rlsp.plan's activation_terms with image tokens) for the same micro-batch, and flips
to checkpointing where the text alone fits and the images do not; rows without images change nothing, data not
counted is bounded by data.max_prompt_length, and `python -m rlsp.check` names the image tokens in its reason.
"""

from __future__ import annotations

import io

import pandas as pd
import pytest
from omegaconf import OmegaConf
from PIL import Image

from rlsp.check import run_checks
from rlsp.config.auto import resolve_auto
from rlsp.config.auto_memory import activation_bytes
from rlsp.config.auto_roles import whole_state
from rlsp.config.layout import RoleLayout, World
from rlsp.config.machine import Machine
from rlsp.config.model_shape import read_model_shape
from rlsp.config.schema import RLSPConfig
from rlsp.data.dataset import prompt_report
from rlsp.data.image_count import largest_row_image_tokens, train_image_tokens
from rlsp.data.multimodal import IMAGE_PLACEHOLDER
from rlsp.data.vision_processor import load_processor
from rlsp.models.tiny_vl import write_tiny_vl_dir
from rlsp.plan.memory import HeadShare, MemoryOptions, Workload, activation_terms

KEY = "actor_rollout_ref.model.enable_gradient_checkpointing"
PROMPT, RESPONSE, TOKENS = 64, 64, 512  # rows of up to 128 tokens, micro-batches of 512


def config(**overrides):
    cfg = OmegaConf.structured(RLSPConfig)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def _png(size: tuple[int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


def _row(i: int, images: list | None) -> dict:
    content = IMAGE_PLACEHOLDER * len(images or []) + "colour?"
    row = {"data_source": "rlsp/shapes", "prompt": [{"role": "user", "content": content}],
           "reward_model": {"style": "rule", "ground_truth": "red"}, "extra_info": {"index": i}}
    return row if images is None else {**row, "images": images}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("auto_images")
    (root / "b.png").write_bytes(_png((40, 24)))
    rows = [_row(0, [{"bytes": _png((32, 32)), "path": None}]),  # 16 image tokens (one per 8x8 pixels)
            _row(1, [{"bytes": _png((32, 32)), "path": None}, {"bytes": _png((16, 16)), "path": None}]),  # 16 + 4
            _row(2, [{"bytes": None, "path": "b.png"}]), _row(3, [])]  # 15 (a path beside the file); none
    pd.DataFrame(rows).to_parquet(root / "images.parquet")
    pd.DataFrame([_row(i, None) for i in range(2)]).to_parquet(root / "text.parquet")
    return {"root": str(root), "vl": write_tiny_vl_dir(str(root / "vl")), "images": str(root / "images.parquet"),
            "text": str(root / "text.parquet")}


def test_counted_from_sizes_as_the_processor_renders_each_row(files):
    processor = load_processor("actor_rollout_ref.model.path", files["vl"])
    rendered = prompt_report([files["images"]], processor.tokenizer, processor=processor).image_tokens
    assert rendered == [16, 20, 15, 0]
    assert largest_row_image_tokens(files["vl"], [files["images"]]) == max(rendered) == 20
    assert largest_row_image_tokens(files["vl"], [files["text"], files["images"]]) == 20
    assert largest_row_image_tokens(files["vl"], [files["text"]]) == 0  # text-only rows
    assert largest_row_image_tokens(files["vl"], [files["root"] + "/missing.parquet"]) is None
    assert largest_row_image_tokens("builtin://tiny-qwen2", [files["images"]]) is None  # no vision tower
    run = config(**{"actor_rollout_ref.model.path": files["vl"], "data.train_files": [files["text"], files["images"]]})
    assert train_image_tokens(run) == 20


def _vl_config(files):
    return config(**{"actor_rollout_ref.model.path": files["vl"], "trainer.n_gpus_per_node": 1,
                     "data.max_prompt_length": PROMPT, "data.max_response_length": RESPONSE,
                     "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": TOKENS})


def _checkpointing(cfg, machine, image_tokens):
    errors: list[str] = []
    choices = {c.key: c for c in resolve_auto(cfg, errors, machine, image_tokens)}
    assert errors == []
    return choices[KEY]


def test_image_activations_flip_checkpointing_and_text_rows_change_nothing(files):
    shape = read_model_shape(files["vl"])
    text = activation_bytes(shape, TOKENS, 4, flash=False)
    w = {n: Workload(RoleLayout(World(1, 1)), TOKENS, PROMPT + RESPONSE, HeadShare(shape.q_heads, shape.kv_heads),
                     image_tokens=n) for n in (0, 20)}
    terms = {n: activation_terms(shape, w[n], "actor", MemoryOptions(dtype_bytes=4))["saved"] for n in w}
    tower = terms[20] - terms[0]  # the planner's tower term for a quarter-image stream: 80 image tokens
    assert tower > 0 and w[20].rank_image_tokens == 80
    state = whole_state(_vl_config(files), "actor", shape)
    machine = Machine("cpu", state + 2 * text + tower, "test")  # room = text + tower / 2: text fits, images do not
    counted = _checkpointing(_vl_config(files), machine, 20)
    assert counted.value is True
    assert "(20 image tokens in the largest row of data.train_files; the vision tower saves" in counted.reason
    assert "for the 80 on a rank)" in counted.reason
    text_rows = _checkpointing(_vl_config(files), machine, 0)
    assert text_rows.value is False and "image" not in text_rows.reason
    bounded = _checkpointing(_vl_config(files), machine, None)  # not counted: max_prompt_length image tokens a row
    assert bounded.value is True and f"up to data.max_prompt_length={PROMPT} image tokens a row" in bounded.reason
    bigger = Machine("cpu", state + 2 * (text + tower), "test")  # room for both: off, naming the images
    assert _checkpointing(_vl_config(files), bigger, 20).value is False
    plain = config(**{"trainer.n_gpus_per_node": 1})  # a text model: the count is not read
    assert _checkpointing(plain, machine, 20).reason == _checkpointing(config(**{"trainer.n_gpus_per_node": 1}),
                                                                       machine, None).reason


def test_check_names_the_image_tokens(files):
    root = files["root"]
    base = ["trainer.device=cpu", f"trainer.cache_dir={root}/cache", f"trainer.default_local_dir={root}/run",
            f"actor_rollout_ref.model.path={files['vl']}", "actor_rollout_ref.rollout.name=hf",
            "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.total_training_steps=1"]
    text = run_checks([*base, f"data.train_files={files['images']}"]).render()
    line = next(x for x in text.splitlines() if f"{KEY}=" in x)
    assert "(20 image tokens in the largest row of data.train_files; the vision tower saves" in line
    text = run_checks([*base, f"data.train_files={files['text']}"]).render()
    line = next(x for x in text.splitlines() if f"{KEY}=" in x)
    assert "image" not in line
