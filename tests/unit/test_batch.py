"""Batch container and rollout row assembly."""

import pytest
import torch

from rlsp.data.batch import Batch
from rlsp.workers.rollout_rows import build_rollout_rows


def test_chunk_concat_roundtrip_keeps_meta_aligned():
    b = Batch.from_dict({"x": torch.arange(6).reshape(6, 1)}, meta={"uid": list("abcdef")})
    parts = b.chunk(3)
    assert [p.meta["uid"] for p in parts] == [["a", "b"], ["c", "d"], ["e", "f"]]
    back = Batch.concat(parts)
    assert torch.equal(back["x"], b["x"]) and back.meta["uid"] == b.meta["uid"]
    with pytest.raises(ValueError, match="cannot split a batch of 6 rows into 4"):
        b.chunk(4)


def test_meta_length_checked():
    with pytest.raises(ValueError, match="meta\\['uid'\\] has 2 rows"):
        Batch.from_dict({"x": torch.zeros(3)}, meta={"uid": ["a", "b"]})


def test_rollout_rows_layout():
    rows = build_rollout_rows([[5, 6], [7]], [[1, 2, 3], []], [[-0.1, -0.2, -0.3], []], 3, 4, pad_id=0)
    assert rows["input_ids"].tolist() == [[0, 5, 6, 1, 2, 3, 0], [0, 0, 7, 0, 0, 0, 0]]
    assert rows["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 1, 0], [0, 0, 1, 0, 0, 0, 0]]
    assert rows["position_ids"].tolist()[0] == [0, 0, 1, 2, 3, 4, 4]
    assert rows["response_mask"].tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]
    assert torch.allclose(rows["rollout_logprobs"][0], torch.tensor([-0.1, -0.2, -0.3, 0.0]))
    with pytest.raises(ValueError, match="response 5 > 4"):
        build_rollout_rows([[1]], [[1] * 5], [[0.0] * 5], 3, 4, pad_id=0)
