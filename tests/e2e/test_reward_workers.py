"""reward_model.num_workers: rule scoring in Ray scoring actors gives what one in-process Scorer gives.

7 rows (one chunk, uneven chunks over 2 and 3 workers), a custom reward that depends on each row's response and
index, and one faulting row scored 0 under reward.on_error=zero: token-level scores, per-row scores
and the error count are equal exactly.
"""

from __future__ import annotations

import pytest
import ray
import torch

from rlsp.data.batch import Batch
from rlsp.models.tokenizer import build_char_tokenizer
from rlsp.trainer.reward_workers import ScoringPool, build_scorer
from rlsp.trainer.scoring import Scorer

pytestmark = pytest.mark.e2e

BODY = ("    if extra_info['index'] == 13:\n        raise ValueError('bad row')\n"
        "    return len(solution_str) + 0.1 * extra_info['index']\n")


def _batch(tok, n: int = 7) -> Batch:
    rows = [tok.encode(str(10 ** (i % 4)), add_special_tokens=False) for i in range(n)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows])
    return Batch.from_dict({"input_ids": ids, "response_mask": mask},
                           meta={"data_source": ["src"] * n, "ground_truth": ["1"] * n,
                                 "extra_info": [{"index": 10 + i} for i in range(n)], "index": [10 + i for i in range(n)]})


def test_reward_workers_equal_one_scorer(tmp_path):
    tok = build_char_tokenizer()
    tok.save_pretrained(str(tmp_path / "tok"))
    fn = tmp_path / "score.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" + BODY)
    single = Scorer(tok, str(fn), on_error="zero")
    expected = _batch(tok)
    want = single.score_rows(expected)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for workers in (1, 2, 3):
            pool = build_scorer(workers, str(tmp_path / "tok"), str(fn), "compute_score", "zero")
            assert isinstance(pool, ScoringPool)
            batch = _batch(tok)
            got = pool.score_rows(batch)
            assert got.tolist() == want.tolist()
            assert torch.equal(batch["token_level_scores"], expected["token_level_scores"])
            assert pool.last_errors == single.last_errors == 1
    finally:
        ray.shutdown()
