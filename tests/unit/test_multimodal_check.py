"""`python -m rlsp.check` on data with images: per-row image-token counts and overlong rows from the model's
processor, and refusals before any worker starts (text-only model, model without a processor, videos without
torchvision, a row whose placeholders do not match its images), each named once."""

from __future__ import annotations

import os
import shutil

import pandas as pd
import pytest

from rlsp.check import run_checks
from rlsp.data.tasks.shapes import write_shapes_parquet
from rlsp.data.vision_processor import has_torchvision
from rlsp.models.tiny_vl import write_tiny_vl_dir


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("vl_check")
    train, _ = write_shapes_parquet(str(root / "shapes"), n_train=8, n_test=1)
    rows = pd.read_parquet(train).head(2)
    bad = rows.copy()
    bad["prompt"] = [[{"role": "user", "content": "<image><image>two?"}], [{"role": "user", "content": "one: <image>"}]]
    bad.to_parquet(root / "bad.parquet")
    video = rows.copy()
    video["videos"] = [[{"bytes": b"frames"}], []]
    video.to_parquet(root / "video.parquet")
    vl = write_tiny_vl_dir(str(root / "vl"))
    shutil.copytree(vl, root / "vl_no_processor")
    os.remove(root / "vl_no_processor" / "preprocessor_config.json")
    return {"root": str(root), "train": train, "bad": str(root / "bad.parquet"), "video": str(root / "video.parquet"),
            "vl": vl, "vl_no_processor": str(root / "vl_no_processor")}


def _check(files: dict[str, str], *overrides: str) -> tuple[str, list[str]]:
    root = files["root"]
    report = run_checks(["trainer.device=cpu", f"trainer.cache_dir={root}/cache", f"trainer.default_local_dir={root}/run",
                         "actor_rollout_ref.rollout.name=hf", "data.train_batch_size=2",
                         "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.total_training_steps=1",
                         f"data.train_files={files['train']}", *overrides])
    return report.render(), report.problems


def test_image_tokens_are_reported_and_bad_rows_named(files):
    text, problems = _check(files, f"actor_rollout_ref.model.path={files['vl']}", f"data.val_files={files['bad']}",
                            "data.max_prompt_length=90")
    assert "train: 8 rows with images; image tokens per row min/mean/max 16/16.0/16 (counted in the prompt lengths)" in text
    assert "train: 1 file(s), 8 rows, prompts up to 84 tokens" in text  # 16 of them image tokens
    assert [p for p in problems if "image" in p] == [f"{files['bad']} row 0 column 'images': the prompt has 2 <image> "
                                                     "placeholder(s) and the row 1 image(s); legal: one <image> per "
                                                     "image, in the order of the list"]
    text, problems = _check(files, f"actor_rollout_ref.model.path={files['vl']}", "data.max_prompt_length=83")
    assert "8 longer than 83 dropped (data.filter_overlong_prompts=true)" in text
    assert any("none of the 8 prompts fits data.max_prompt_length=83" in p for p in problems)


def test_models_that_cannot_read_images_are_refused_once(files):
    _, problems = _check(files)  # rlsp's built-in text model
    image_problems = [p for p in problems if "images" in p]
    assert len(image_problems) == 1, problems
    assert image_problems[0].startswith(f"data.image_key='images': {files['train']} has images in 8 rows, and "
                                        "actor_rollout_ref.model.path=")
    assert "is a qwen2 text-only model (no vision tower)" in image_problems[0]
    _, problems = _check(files, f"actor_rollout_ref.model.path={files['vl_no_processor']}",
                         f"data.val_files={files['video']}")
    assert any(p.startswith("data.image_key='images'") and "has no preprocessor_config.json" in p for p in problems)
    if not has_torchvision():
        assert any(p.startswith(f"data.video_key='videos': {files['video']} has videos in 1 rows; video frames need "
                                "the model's video processor, which needs torchvision") for p in problems), problems
