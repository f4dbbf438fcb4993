"""The synthetic shapes task (rlsp.data.tasks.shapes) and its rule reward (rlsp.rewards.shapes): deterministic
rows in verl's multimodal layout whose images show what the ground truth says, and every reward tier."""

from __future__ import annotations

import io
import random

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from rlsp.data.tasks.shapes import COLOURS, DATA_SOURCE, _draw, generate_shapes, main, make_row
from rlsp.rewards.registry import get_reward_fn, score_batch
from rlsp.rewards.shapes import score_shapes


def _colours(png: bytes) -> dict[str, int]:
    """Pixels of each task colour in the image (the background is white; PIL draws without anti-aliasing)."""
    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).reshape(-1, 3)
    counts = {name: int((pixels == rgb).all(axis=-1).sum()) for name, rgb in COLOURS.items()}
    assert sum(counts.values()) + int((pixels == 255).all(axis=-1).sum()) == len(pixels)  # nothing else drawn
    return counts


def test_rows_are_deterministic_and_show_their_answer():
    train, test = generate_shapes(n_train=8, n_test=4, seed=3, kinds=("colour", "count"))
    again, _ = generate_shapes(n_train=8, n_test=4, seed=3, kinds=("colour", "count"))
    assert train == again and train != generate_shapes(n_train=8, n_test=4, seed=4, kinds=("colour", "count"))[0]
    assert [r["extra_info"]["kind"] for r in train] == ["colour", "count"] * 4 and len(test) == 4
    colours = sorted(r["reward_model"]["ground_truth"] for r in train if r["extra_info"]["kind"] == "colour")
    assert colours == sorted(COLOURS)  # training answers cycle uniformly
    for row in train:
        assert row["data_source"] == DATA_SOURCE and row["prompt"][0]["content"].startswith("<image>")
        assert row["prompt"][0]["content"] == row["prompt"][0]["content"].lower()  # the char tokenizer has no capitals
        pixels = _colours(row["images"][0]["bytes"])
        info = row["extra_info"]
        assert Image.open(io.BytesIO(row["images"][0]["bytes"])).size == (48, 48)
        if info["kind"] == "colour":
            assert [c for c, n in pixels.items() if n] == [row["reward_model"]["ground_truth"]]
        else:
            assert row["reward_model"]["ground_truth"] == str(info["count"]) and pixels[info["colour"]] > 0
            assert f"how many {info['colour']} {info['shape']}s" in row["prompt"][0]["content"]


def _blobs(png: bytes, rgb: tuple[int, int, int]) -> list[int]:
    """Pixel areas of the 4-connected regions of colour `rgb`."""
    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    todo = {(int(y), int(x)) for y, x in zip(*np.nonzero((pixels == rgb).all(axis=-1)))}
    areas = []
    while todo:
        stack, area = [todo.pop()], 0
        while stack:
            y, x = stack.pop()
            area += 1
            for nb in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if nb in todo:
                    todo.remove(nb)
                    stack.append(nb)
        areas.append(area)
    return areas


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_count_rows_hold_that_many_shapes_of_the_asked_kind(seed):
    row = make_row("count", "3", "train", 0, random.Random(seed))
    info = row["extra_info"]
    one = _draw([(info["colour"], info["shape"])], 48, random.Random(0))  # the area of one such shape
    (area,) = _blobs(one, COLOURS[info["colour"]])
    assert _blobs(row["images"][0]["bytes"], COLOURS[info["colour"]]).count(area) == 3  # shapes never touch


@pytest.mark.parametrize(("response", "truth", "score"), [
    ("red", "red", 1.0), (" Red.<|im_end|>", "red", 1.0), ("red square", "red", 0.5), ("blue", "red", 0.1),
    ("purple", "red", 0.0), ("", "red", 0.0), ("3", "3", 1.0), ("03", "3", 1.0), ("3 squares", "3", 0.5),
    ("30", "3", 0.1), ("2", "3", 0.1), ("red", "3", 0.0), ("three", "3", 0.0),
    ("r", "red", 0.05 / 3), ("re", "red", 0.1 / 3), ("rxq", "red", 0.05 / 3), ("yell<|im_end|>", "yellow", 0.05 * 4 / 6),
    ("x", "3", 0.0), ("ed", "red", 0.0),
])
def test_reward_tiers(response, truth, score):
    assert score_shapes(response, truth) == pytest.approx(score, rel=1e-12)
    assert get_reward_fn(DATA_SOURCE)(DATA_SOURCE, response, truth) == pytest.approx(score, rel=1e-12)


def test_cli_writes_parquet_the_reward_scores(tmp_path):
    main(["--out", str(tmp_path), "--n-train", "4", "--n-test", "2", "--kinds", "count"])
    frame = pd.read_parquet(tmp_path / "train.parquet")
    assert list(frame.columns) == ["data_source", "prompt", "images", "ability", "reward_model", "extra_info"]
    truths = [r["ground_truth"] for r in frame["reward_model"]]
    assert score_batch(list(frame["data_source"]), truths, truths) == [1.0] * 4
    with pytest.raises(ValueError, match=r"kinds=\('size',\): each must be one of \['colour', 'count'\]"):
        generate_shapes(kinds=("size",))
