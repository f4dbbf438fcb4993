"""verl 0.9 keys of its vision-language scripts that rlsp accepts where they give verl's result (the Qwen3.5 image and
video scripts of tests/unit/test_verl_commands_0_9.py set them):

* `actor_rollout_ref.rollout.prompt_length` / `response_length`: verl's engine caps, defaulting to the data lengths;
  null or those lengths accepted, any other value refused naming the key, the value and the legal ones
  (rlsp.config.validate_verl_runtime);
* `data.image_patch_size`: verl 0.9 resizes images with it only to count prompt lengths, and rolls out with the
  processor's patch size; null or the processor's accepted, another value refused on data with images, before any
  worker starts (rlsp.data.vision_processor.image_patch_size_errors, the preflight `vision_data` check), and
  accepted on data without images (it changes nothing there).
"""

from __future__ import annotations

import os
import shutil

import pandas as pd
import pytest

from rlsp.check import run_checks
from rlsp.config.compose import compose_config
from rlsp.config.validate import validate_config
from rlsp.config.validate_keys import schema_keys
from rlsp.config.verl_compat import verl_note
from rlsp.config.verl_keys import answer
from rlsp.data.tasks.shapes import write_shapes_parquet
from rlsp.data.vision_processor import image_patch_size_errors, load_processor
from rlsp.models.tiny_vl import PATCH, write_tiny_vl_dir

MODEL_KEY = "actor_rollout_ref.model.path"
LENGTHS = ("data.max_prompt_length=16", "data.max_response_length=8")


def _cfg(*overrides: str):
    return compose_config(overrides=["trainer.device=cpu", *LENGTHS, *overrides])


@pytest.mark.parametrize("key,length", [("prompt_length", 16), ("response_length", 8)])
def test_rollout_lengths_accepted_when_they_are_the_data_lengths(key: str, length: int) -> None:
    data_key = f"data.max_{key}"
    for ok in ("null", str(length), f"${{{data_key}}}"):  # verl's default interpolates the data length
        validate_config(_cfg(f"actor_rollout_ref.rollout.{key}={ok}"))
    for bad in (length - 1, length + 1):
        with pytest.raises(ValueError) as err:
            validate_config(_cfg(f"actor_rollout_ref.rollout.{key}={bad}"))
        (line,) = [x for x in str(err.value).splitlines() if f"rollout.{key}" in x]
        assert line == (f"  - actor_rollout_ref.rollout.{key}={bad} differs from {data_key}={length}: rlsp's rollout "
                        f"engine {'takes prompts of up to' if key == 'prompt_length' else 'generates up to'} "
                        f"{data_key} tokens (verl's default for actor_rollout_ref.rollout.{key}) and has no separate "
                        f"cap; legal values: null or {length} ({data_key} sets the limit)")
    kind, note = answer(f"actor_rollout_ref.rollout.{key}", set(schema_keys()))
    assert kind == "rlsp" and f"null or {data_key}" in note and note == verl_note(f"actor_rollout_ref.rollout.{key}")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("patch")
    images, _ = write_shapes_parquet(str(root / "shapes"), n_train=4, n_test=1)
    text = pd.read_parquet(images).drop(columns=["images"])
    text["prompt"] = [[{"role": "user", "content": "what colour?"}]] * len(text)
    text.to_parquet(root / "text.parquet")
    vl = write_tiny_vl_dir(str(root / "vl"))
    shutil.copytree(vl, root / "vl_no_processor")
    os.remove(root / "vl_no_processor" / "preprocessor_config.json")
    return {"root": str(root), "images": images, "text": str(root / "text.parquet"), "vl": vl,
            "vl_no_processor": str(root / "vl_no_processor")}


def test_patch_size_is_the_processors_or_refused_on_images(files) -> None:
    patch = load_processor(MODEL_KEY, files["vl"]).image_processor.patch_size
    assert patch == PATCH
    for ok in (None, PATCH):
        assert image_patch_size_errors(ok, MODEL_KEY, files["vl"], [files["text"], files["images"]]) == []
    for bad in (PATCH + 1, 14, 16):
        assert image_patch_size_errors(bad, MODEL_KEY, files["vl"], [files["text"], files["images"]]) == [
            f"data.image_patch_size={bad}: {files['images']} has images in 4 rows, and the processor of {MODEL_KEY}="
            f"{files['vl']!r} resizes them with patch_size={PATCH}; verl 0.9 would count their prompt lengths with "
            f"{bad} while rolling out with {PATCH}, and rlsp reads every image with the processor's; legal values: "
            f"null or {PATCH}"]
        assert image_patch_size_errors(bad, MODEL_KEY, files["vl"], [files["text"]]) == []  # no images: no effect
    # no processor: vision_data_errors names the model once; this check adds nothing
    assert image_patch_size_errors(16, MODEL_KEY, files["vl_no_processor"], [files["images"]]) == []
    kind, note = answer("data.image_patch_size", set(schema_keys()))
    assert kind == "rlsp" and note.startswith("null or the model processor's patch_size")
    with pytest.raises(ValueError, match=r"data.image_patch_size=0 must be an integer >= 1"):
        validate_config(_cfg("data.image_patch_size=0"))


def test_rlsp_check_refuses_another_patch_size_before_workers_start(files) -> None:
    root = files["root"]
    common = ["trainer.device=cpu", f"trainer.cache_dir={root}/cache", f"trainer.default_local_dir={root}/run",
              "actor_rollout_ref.rollout.name=hf", "data.train_batch_size=2", "data.max_prompt_length=96",
              "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.total_training_steps=1",
              f"{MODEL_KEY}={files['vl']}", f"data.train_files={files['images']}"]
    report = run_checks([*common, "data.image_patch_size=16", "actor_rollout_ref.rollout.prompt_length=96"])
    assert [p for p in report.problems if "image_patch_size" in p] == [
        image_patch_size_errors(16, MODEL_KEY, files["vl"], [files["images"]])[0]]
    assert len(report.problems) == 1, report.problems
    rendered = report.render()
    assert "data.image_patch_size: null or the model processor's patch_size" in rendered  # the note, printed
    assert "actor_rollout_ref.rollout.prompt_length: verl's cap on the prompts" in rendered
    report = run_checks([*common, f"data.image_patch_size={PATCH}"])
    assert report.problems == [], report.problems
