"""Reward-function faults are reported with the offending row, or scored 0 and counted; never a silent
NaN. Non-finite training metrics stop the run; an empty dataset says it is empty."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from rlsp.data.batch import Batch
from rlsp.data.dataset import PromptDataset
from rlsp.models.tokenizer import build_char_tokenizer
from rlsp.rewards.scoring import RewardError, Scorer
from rlsp.step.batch_metrics import check_finite


def _reward_file(tmp_path, body: str) -> str:
    path = tmp_path / "score.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" + body)
    return str(path)


def _batch(n: int = 3) -> Batch:
    tok = build_char_tokenizer()
    ids = torch.tensor([tok.encode("12", add_special_tokens=False)] * n)
    return Batch.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": torch.ones(n, ids.shape[1])},
                           meta={"data_source": ["src"] * n, "ground_truth": ["3"] * n,
                                 "extra_info": [{"index": 10 + i} for i in range(n)], "index": [10 + i for i in range(n)]})


@pytest.mark.parametrize("body,needle", [
    ("    if extra_info['index'] == 11:\n        raise KeyError('answer')\n    return 1.0\n", "raised KeyError: 'answer'"),
    ("    return float('nan') if extra_info['index'] == 11 else 1.0\n", "returned nan (a reward must be a finite number)"),
    ("    return 'yes' if extra_info['index'] == 11 else 1.0\n", "returned 'yes'"),
])
def test_bad_reward_is_reported_with_its_row_or_scored_zero(tmp_path, body, needle):
    path = _reward_file(tmp_path, body)
    with pytest.raises(RewardError) as err:
        Scorer(build_char_tokenizer(), path).score_rows(_batch())
    assert needle in str(err.value) and "data_source='src', row index=11" in str(err.value)
    assert "compute_score" in str(err.value) and "reward.on_error=zero" in str(err.value)
    scorer = Scorer(build_char_tokenizer(), path, on_error="zero")
    scores = scorer.score_rows(_batch())
    assert scores.tolist() == [1.0, 0.0, 1.0] and scorer.last_errors == 1


def test_non_finite_metrics_stop_the_run():
    check_finite({"reward/mean": 0.5, "actor/pg_loss": 0.1, "timing/gen_s": math.inf}, step=3)  # timing is not checked
    with pytest.raises(RuntimeError, match=r"step 3: non-finite \{'actor/grad_norm': nan\}"):
        check_finite({"reward/mean": 0.5, "actor/grad_norm": float("nan")}, step=3)


def test_empty_and_too_long_datasets_say_so(tmp_path):
    empty = tmp_path / "empty.parquet"
    pd.DataFrame({"prompt": pd.Series([], dtype=str)}).to_parquet(empty)
    with pytest.raises(ValueError, match="is empty \\(0 rows\\)"):
        PromptDataset(str(empty), build_char_tokenizer(), 32)
    long = tmp_path / "long.parquet"
    pd.DataFrame({"prompt": ["1+1=" * 40], "data_source": ["x"], "reward_model": [{"ground_truth": "2"}]}).to_parquet(long)
    with pytest.raises(ValueError, match="none of the 1 prompts .* fits data.max_prompt_length=8"):
        PromptDataset(str(long), build_char_tokenizer(), 8)
