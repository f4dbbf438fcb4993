"""`python -m rlsp.data.preprocess geo3k` on a small Geometry3K-layout sample (images drawn here with PIL), and
verl's geo3k rule reward (rlsp.rewards.geo3k)."""

from __future__ import annotations

import io
import json

import pandas as pd
import pytest
from PIL import Image, ImageDraw

from rlsp.data.preprocess import main, preprocess
from rlsp.data.vision_geo3k import GEO3K_INSTRUCTION, GEO3K_SOURCE
from rlsp.rewards.registry import get_reward_fn


def _diagram(side: int) -> bytes:
    image = Image.new("RGB", (side, side), "white")
    ImageDraw.Draw(image).polygon([(2, side - 2), (side - 2, side - 2), (2, 2)], outline="black")
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


RECORDS = [("<image>Find x. The legs are 3 and 4.", "5"), ("<image>Find the area of the triangle.", "2\\sqrt{3}")]


def test_parquet_and_jsonl_samples_become_verl_rows(tmp_path):
    pngs = [_diagram(40), _diagram(24)]
    hub = [{"images": [{"bytes": png, "path": None}], "problem": p, "answer": a} for png, (p, a) in zip(pngs, RECORDS)]
    pd.DataFrame(hub).to_parquet(tmp_path / "train-00000.parquet")
    out = preprocess("geo3k", str(tmp_path / "train-00000.parquet"), str(tmp_path / "out"), split="train")
    frame = pd.read_parquet(out)
    assert list(frame.columns) == ["data_source", "prompt", "images", "ability", "reward_model", "extra_info"]
    row = frame.iloc[1]
    assert row["data_source"] == GEO3K_SOURCE and row["ability"] == "math"
    assert list(row["prompt"]) == [{"role": "user", "content": f"{RECORDS[1][0]} {GEO3K_INSTRUCTION}"}]
    assert [im["bytes"] for im in row["images"]] == [pngs[1]]
    assert row["reward_model"] == {"style": "rule", "ground_truth": "2\\sqrt{3}"}
    assert row["extra_info"] == {"split": "train", "index": 1, "answer": "2\\sqrt{3}", "question": RECORDS[1][0]}
    (tmp_path / "img").mkdir()  # a JSON-lines export whose images are files next to it
    (tmp_path / "img" / "0.png").write_bytes(pngs[0])
    (tmp_path / "test.jsonl").write_text(json.dumps({"images": ["img/0.png"], "problem": RECORDS[0][0], "answer": "5"}))
    main(["geo3k", "--input", str(tmp_path / "test.jsonl"), "--output", str(tmp_path / "out"), "--split", "test"])
    assert pd.read_parquet(tmp_path / "out" / "test.parquet").iloc[0]["images"][0]["bytes"] == pngs[0]


@pytest.mark.parametrize(("record", "needle"), [
    ({"problem": "<image>x?", "answer": "1"}, r"geo3k record 0 lacks \['images'\]"),
    ({"problem": "x?", "answer": "1", "images": ["d.png"]}, r"has 0 <image> placeholder\(s\) and the record 1"),
    ({"problem": "<image>x?", "answer": "1", "images": ["gone.png"]}, r"row 0 column 'images' image 0: file .*gone"),
])
def test_bad_records_are_refused(tmp_path, record, needle):
    (tmp_path / "d.png").write_bytes(_diagram(16))
    (tmp_path / "in.jsonl").write_text(json.dumps(record))
    with pytest.raises(ValueError, match=needle):
        preprocess("geo3k", str(tmp_path / "in.jsonl"), str(tmp_path / "out"))


@pytest.mark.parametrize(("response", "score"), [
    ("<think>3-4-5 triangle</think> The answer is \\boxed{5}.", 1.0),
    ("<think>a</think>\\boxed{5.0}<|im_end|>", 1.0),
    ("It is \\boxed{5}", 0.9),
    ("<think>guess</think> \\boxed{6}", 0.1),
    ("<think>no box</think> 5", 0.0),
    ("5", 0.0),
])
def test_verl_geo3k_reward(response, score):
    assert get_reward_fn(GEO3K_SOURCE)(GEO3K_SOURCE, response, "5") == pytest.approx(score, abs=1e-12)
    assert get_reward_fn(GEO3K_SOURCE)(GEO3K_SOURCE, "<think></think>\\boxed{2 \\sqrt 3}", "2\\sqrt{3}") == 1.0
