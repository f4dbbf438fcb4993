"""DAPO's driver-side features (arXiv:2503.14476): overlong reward shaping (eq. 13, verl's dapo reward manager)
and dynamic sampling (verl's algorithm.filter_groups), checked against values worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlsp.data.batch import Batch
from rlsp.models.tokenizer import build_char_tokenizer
from rlsp.rewards.overlong import OverlongShaping, compute_overlong_penalty
from rlsp.rewards.scoring import Scorer
from rlsp.step.dynamic_sampling import GroupCollector, informative_groups, sample_metric

# ---------------------------------------------------------------------------------------------- overlong shaping


def test_overlong_penalty_by_hand():
    # L_max=8, L_cache=4: no penalty up to 8 - 4 = 4 tokens, then -(L - 4) / 4 * factor, -factor at 8 and beyond.
    lengths = torch.tensor([0, 1, 3, 4, 5, 6, 7, 8, 11])
    expected_1 = [0.0, 0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    got = compute_overlong_penalty(lengths, max_resp_len=8, buffer_len=4, penalty_factor=1.0)
    assert got.dtype == torch.float64 and got.tolist() == expected_1  # exact: quarters are exact in binary
    got = compute_overlong_penalty(lengths, max_resp_len=8, buffer_len=4, penalty_factor=0.5)
    assert got.tolist() == [x / 2 for x in expected_1]
    # L_cache = L_max: the penalty starts at the first token; 3 tokens of 10 -> -0.3 * 2.0
    got = compute_overlong_penalty(torch.tensor([0, 3, 10]), max_resp_len=10, buffer_len=10, penalty_factor=2.0)
    torch.testing.assert_close(got, torch.tensor([0.0, -0.6, -2.0], dtype=torch.float64), rtol=0, atol=1e-15)
    # L_cache = 1: only a response at the limit is penalised
    got = compute_overlong_penalty(torch.tensor([6, 7]), max_resp_len=7, buffer_len=1, penalty_factor=1.0)
    assert got.tolist() == [0.0, -1.0]


@pytest.mark.parametrize("buffer_len", [0, 9])
def test_overlong_penalty_refuses_a_buffer_outside_the_limit(buffer_len):
    with pytest.raises(ValueError, match=rf"len={buffer_len} must be in \[1, max_resp_len=8\]"):
        compute_overlong_penalty(torch.tensor([3]), 8, buffer_len, 1.0)


def _scored_batch(lengths: list[int], R: int = 8, P: int = 2) -> Batch:
    """Rows with a prompt of P tokens and responses of `lengths` tokens, scored 1, 0, 1, ... on the last token."""
    B = len(lengths)
    response_mask = torch.tensor([[1.0] * n + [0.0] * (R - n) for n in lengths])
    attention = torch.cat([torch.ones(B, P), response_mask], dim=1)
    scores = torch.zeros(B, R)
    for i, n in enumerate(lengths):
        if n:
            scores[i, n - 1] = float(i % 2 == 0)
    return Batch.from_dict({"input_ids": torch.zeros(B, P + R, dtype=torch.long), "attention_mask": attention,
                            "response_mask": response_mask, "token_level_scores": scores},
                           meta={"uid": [f"g{i // 2}" for i in range(B)]})


def test_shaping_adds_the_penalty_on_the_last_token_and_logs_it():
    batch = _scored_batch([2, 5, 7, 8])
    shaping = OverlongShaping(max_resp_len=8, buffer_len=4, penalty_factor=1.0, log=True)
    penalty = shaping.apply(batch)
    assert penalty.tolist() == [0.0, -0.25, -0.75, -1.0]
    expected = torch.zeros(4, 8)
    expected[0, 1] = 1.0            # row 0: score 1, 2 tokens, no penalty
    expected[1, 4] = 0.0 - 0.25     # row 1: score 0, 5 tokens
    expected[2, 6] = 1.0 - 0.75     # row 2: score 1, 7 tokens
    expected[3, 7] = 0.0 - 1.0      # row 3: score 0, 8 tokens (the limit)
    torch.testing.assert_close(batch["token_level_scores"], expected, rtol=0, atol=0)
    assert batch["overlong_reward"].tolist() == [0.0, -0.25, -0.75, -1.0]
    assert shaping.metrics(batch) == {"reward/overlong_reward/mean": -0.5, "reward/overlong/ratio": 0.75}
    assert OverlongShaping(8, 4, 1.0, log=False).metrics(batch) == {}


def test_shaping_of_multi_turn_rows_counts_tool_tokens():
    # A trajectory of 7 response tokens whose tokens 2-4 are tool output: L = 7, the score sits on the last
    # policy token (index 6), as the Scorer places it.
    batch = _scored_batch([7])
    batch["response_mask"][0, 2:5] = 0.0
    OverlongShaping(8, 4, 2.0).apply(batch)
    expected = torch.zeros(1, 8)
    expected[0, 6] = 1.0 - 0.75 * 2.0
    torch.testing.assert_close(batch["token_level_scores"], expected, rtol=0, atol=0)


def test_shaping_after_the_rule_scorer(tmp_path):
    # The reward function's values stay what the Scorer returns (accuracy, filter metric); the tokens carry both.
    tok = build_char_tokenizer()
    path = tmp_path / "score.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return 1.0 if solution_str.startswith('1') else 0.0\n")
    texts = ["12", "1234567", "9876543"]
    R = 8
    ids = torch.zeros(3, 1 + R, dtype=torch.long)
    mask = torch.zeros(3, R)
    for i, text in enumerate(texts):
        enc = tok.encode(text, add_special_tokens=False)
        ids[i, 1:1 + len(enc)] = torch.tensor(enc)
        mask[i, :len(enc)] = 1.0
    batch = Batch.from_dict({"input_ids": ids, "attention_mask": torch.cat([torch.ones(3, 1), mask], 1),
                             "response_mask": mask},
                            meta={"data_source": ["s"] * 3, "ground_truth": ["x"] * 3})
    scores = Scorer(tok, str(path)).score_rows(batch)
    OverlongShaping(max_resp_len=8, buffer_len=4, penalty_factor=1.0).apply(batch)
    assert scores.tolist() == [1.0, 1.0, 0.0]
    assert batch["token_level_scores"].sum(-1).tolist() == [1.0, 1.0 - 0.75, 0.0 - 0.75]


# ---------------------------------------------------------------------------------------------- dynamic sampling


def test_informative_groups_by_hand():
    uids = ["a", "a", "a", "b", "b", "b", "c", "c", "c", "d", "e", "e"]
    values = np.array([1, 1, 1, 0, 1, 0, 0, 0, 0, 1, 0.5, 0.5])
    kept, dropped = informative_groups(uids, values)
    # a: all 1 (dropped); b: 0/1 (kept); c: all 0 (dropped); d: one sample (kept, as verl); e: equal (dropped)
    assert kept == ["b", "d"] and dropped == ["a", "c", "e"]


def test_each_metric_reads_its_value():
    batch = _scored_batch([2, 5, 7, 8])
    OverlongShaping(8, 4, 1.0).apply(batch)  # seq_reward sees the shaped scores: [1, -0.25, 0.25, -1]
    scores = np.array([1.0, 0.0, 1.0, 0.0])
    assert sample_metric("acc", batch, scores).tolist() == [1.0, 0.0, 1.0, 0.0]
    assert sample_metric("score", batch, scores).tolist() == [1.0, 0.0, 1.0, 0.0]
    assert sample_metric("seq_reward", batch, scores).tolist() == [1.0, -0.25, 0.25, -1.0]
    assert sample_metric("seq_final_reward", batch, scores).tolist() == [1.0, -0.25, 0.25, -1.0]  # no KL yet
    batch.set("token_level_rewards", batch["token_level_scores"] - 0.125 * batch["response_mask"])
    assert sample_metric("seq_final_reward", batch, scores).tolist() == [1.0 - 0.25, -0.25 - 0.625,
                                                                          0.25 - 0.875, -1.0 - 1.0]
    with pytest.raises(ValueError, match="legal values"):
        sample_metric("entropy", batch, scores)
    # A reward function returning dicts: acc and score are its entries (verl's reward_extra_info).
    batch.meta["reward_extra_info"] = [{"score": 1.0, "acc": 0.0}, {"score": 0.5, "acc": 1.0}, {"score": 2.0},
                                       {"score": 0.0, "acc": 1.0}]
    assert sample_metric("score", batch, scores).tolist() == [1.0, 0.5, 2.0, 0.0]
    with pytest.raises(RuntimeError, match=r"metric='acc': the reward function returned a dict without 'acc' "
                                           r"\(keys: \['score'\]\)"):
        sample_metric("acc", batch, scores)
    batch.meta["reward_extra_info"][2]["acc"] = 1.0
    assert sample_metric("acc", batch, scores).tolist() == [0.0, 1.0, 1.0, 1.0]


def _round(groups: list[list[float]], tag: str) -> tuple[Batch, np.ndarray]:
    """A generated batch: one group of samples per entry, each sample's reward function value given."""
    uids = [f"{tag}g{g}" for g, vals in enumerate(groups) for _ in vals]
    scores = np.array([v for vals in groups for v in vals])
    B = len(uids)
    batch = Batch.from_dict({"response_mask": torch.ones(B, 3), "token_level_scores": torch.zeros(B, 3)},
                            meta={"uid": uids})
    return batch, scores


def test_collector_keeps_informative_groups_and_trims_to_the_batch_size():
    c = GroupCollector("acc", prompts_needed=3, prompts_per_batch=4, max_num_gen_batches=0)
    c.add(*_round([[1, 1], [0, 1], [0, 0], [1, 1]], "r1"), errors=1)  # 1 informative of 4
    assert not c.ready and c.kept_uids == ["r1g1"] and c.filtered == 3
    c.check_limit()  # 0: no limit
    c.add(*_round([[0, 1], [1, 0], [1, 1], [1, 0]], "r2"), errors=2)  # 3 informative: 4 in all, 3 needed
    assert c.ready
    batch, metrics = c.take()
    assert batch.meta["uid"] == ["r1g1", "r1g1", "r2g0", "r2g0", "r2g1", "r2g1"]  # the first 3 groups collected
    assert batch.meta["row_score"] == [0.0, 1.0, 0.0, 1.0, 1.0, 0.0]  # each row's own value went with it
    assert metrics == {"train/num_gen_batches": 2.0, "train/num_groups_kept": 4.0, "train/num_groups_filtered": 4.0,
                       "train/num_groups_trimmed": 1.0, "reward/errors": 3.0}


def test_collector_counts_units_as_fractions_of_a_batch():
    # The async pool delivers units of 2 prompts; a generation batch is train_batch_size = 4 prompts.
    c = GroupCollector("acc", prompts_needed=4, prompts_per_batch=4, max_num_gen_batches=0)
    for tag in ("u1", "u2", "u3"):
        c.add(*_round([[0, 1], [1, 1]], tag))
    assert len(c.kept_uids) == 3 and c.num_gen_batches == 1.5
    c.add(*_round([[0, 1], [1, 0]], "u4"))
    batch, metrics = c.take()
    assert len(set(batch.meta["uid"])) == 4 and len(batch) == 8
    assert metrics["train/num_gen_batches"] == 2.0 and metrics["train/num_groups_trimmed"] == 1.0


def test_collector_gives_up_after_max_num_gen_batches():
    c = GroupCollector("seq_reward", prompts_needed=2, prompts_per_batch=2, max_num_gen_batches=2)
    c.add(*_round([[1, 1], [0, 0]], "r1"))  # seq_reward: token sums, all zero here -> both dropped
    c.check_limit()  # 1 of 2 rounds
    c.add(*_round([[0, 1], [0, 1]], "r2"))
    with pytest.raises(RuntimeError, match=r"2 generation batches \(algorithm.filter_groups.max_num_gen_batches=2\)"
                                           r" gave 0 prompts .* of the 2 a step needs .*set it to 0 for no limit"):
        c.check_limit()
