"""DAPO's dynamic sampling reads per-row values only: the seq_* metrics are each row's sum of its token-level
scores computed from the per-row parts they are built of (rlsp.rewards.token_scores.shaped_row_sums), every row
compared with the token columns' sums; the collector filters and concatenates generation rounds of a step
whose rows stay on the workers without reading any [rows x response] column, and the kept rows still build
their token-level scores when something reads them.

The step's blocks are the Batches themselves and its worker group builds rows in this process with
`assemble`, as a worker does (tests/unit/test_step_reads.py's LocalGroup).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_step_reads import LocalGroup
from tolerances import assert_tensor_close, roundoff_rtol

from rlsp.controller.reads import read_columns
from rlsp.controller.reward_workers import set_row_scores
from rlsp.controller.step_data import StepData, from_results
from rlsp.data.batch import Batch
from rlsp.rewards.overlong import OverlongShaping
from rlsp.rewards.token_scores import shaped_row_sums, shaped_token_scores
from rlsp.step.dynamic_sampling import ROW_PARTS, GroupCollector, informative_groups, sample_metric, seq_rewards
from rlsp.step.reward import derive_shaped_scores, overlong_penalties
from rlsp.workers.columns import row_report
from rlsp.workers.roles.reward_model import place_on_last_token
from rlsp.workers.roles.rollout import ROLLOUT_REPORTS

P, R = 3, 8
SHAPING = OverlongShaping(max_resp_len=R, buffer_len=4, penalty_factor=0.75)


def _rows(lengths: list[int], seed: int, tool_only: int = 1) -> Batch:
    """Generated rows of `lengths` response tokens (0: none): multi-turn masks with tool tokens (0) inside, row
    `tool_only` a response of tool output only (no policy token), step rewards on policy and on tool tokens."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    attention = torch.zeros(B, P + R)
    attention[:, :P] = 1
    mask = torch.zeros(B, R)
    for i, n in enumerate(lengths):
        attention[i, P:P + n] = 1
        mask[i, :n] = 1
        if n > 3:
            mask[i, 1:3] = 0  # tool output between two turns
    mask[tool_only] = 0
    step = torch.where(torch.rand(B, R, generator=g) < 0.4, torch.randn(B, R, generator=g), torch.zeros(B, R))
    step = step * attention[:, P:]  # within the trajectory, on policy and tool tokens alike
    return Batch.from_dict({"input_ids": torch.randint(0, 50, (B, P + R), generator=g), "attention_mask": attention,
                            "response_mask": mask, "step_rewards": step})


def _rewards(B: int, seed: int) -> torch.Tensor:
    """Rule rewards of both signs that float32 does not hold exactly (the scorers report float64)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, generator=g, dtype=torch.float64) / 3


# ------------------------------------------------------------------------------------------- shaped_row_sums


@pytest.mark.parametrize("overlong", [False, True])
def test_row_sums_of_rule_rewards_equal_the_token_sums_bit_for_bit(overlong: bool) -> None:
    rows = _rows([8, 6, 0, 5, 3, 8, 7, 1], seed=0)
    reward_B = torch.as_tensor(_rewards(len(rows), 1).numpy(), dtype=torch.float32)  # as set_row_scores keeps it
    penalty_B = overlong_penalties(SHAPING, rows) if overlong else None
    want_B = shaped_token_scores(rows["response_mask"], reward_B, None, penalty_B).sum(-1)
    got_B = shaped_row_sums(rows["response_mask"].sum(-1), reward_B, None, penalty_B)
    assert torch.equal(got_B, want_B) and got_B.dtype == want_B.dtype
    assert got_B[1] == 0 and got_B[2] == 0  # no policy token: no reward, no penalty
    if overlong:  # the penalty counts every response token, tool output included
        assert (penalty_B[[0, 5, 6]] < 0).all() and torch.equal(got_B[0], reward_B[0] + penalty_B[0].float())


def test_row_sums_of_reward_model_scores_equal_the_token_sums() -> None:
    rows = _rows([8, 6, 0, 5, 3], seed=2)
    rm_scores_BR = place_on_last_token(_rewards(len(rows), 3), rows["response_mask"])
    rows.set("rm_scores", rm_scores_BR)
    rm_score_B = row_report(rows, ("rm_score",))["rm_score"]  # what the reward model's workers report per row
    want_B = shaped_token_scores(rows["response_mask"], None, rm_scores_BR).sum(-1)
    assert torch.equal(shaped_row_sums(rows["response_mask"].sum(-1), None, rm_score_B), want_B)


@pytest.mark.parametrize("source", ["rule", "rule+overlong", "reward_model"])
def test_row_sums_with_step_rewards_equal_the_token_sums_up_to_roundoff(source: str) -> None:
    rows = _rows([8, 6, 0, 5, 3, 8, 7, 2], seed=4)
    mask_BR, tokens_B = rows["response_mask"], rows["response_mask"].sum(-1)
    step_sum_B = row_report(rows, ("step_reward_policy_sum",))["step_reward_policy_sum"]  # reported by the rollout
    assert not torch.equal(step_sum_B, rows["step_rewards"].sum(-1))  # step rewards on tool tokens do not count
    reward_B = torch.as_tensor(_rewards(len(rows), 5).numpy(), dtype=torch.float32)
    penalty_B = overlong_penalties(SHAPING, rows) if source == "rule+overlong" else None
    if source == "reward_model":
        rm_BR = place_on_last_token(reward_B, mask_BR)
        parts, row_parts = (None, rm_BR, None), (None, rm_BR.sum(-1), None)
    else:
        parts, row_parts = (reward_B, None, penalty_B), (reward_B, None, penalty_B)
    scores_BR = shaped_token_scores(mask_BR, *parts, step_rewards_BR=rows["step_rewards"])
    got_B = shaped_row_sums(tokens_B, *row_parts, step_sum_B=step_sum_B)
    # Both sum the same nonzero terms in another order (the outcome joins the last token's step reward in the
    # columns): derivation 1 of tests/tolerances.py, one reduction of at most R + 2 terms, at the terms' scale.
    for i in range(len(rows)):
        assert_tensor_close(got_B[i], scores_BR[i].sum(), roundoff_rtol(reduction=R + 2, stages=1),
                            value_scale=float(scores_BR[i].abs().sum() + reward_B[i].abs()))


def test_row_sums_refuse_missing_and_unshaped_parts() -> None:
    tokens_B = torch.ones(2)
    with pytest.raises(ValueError, match=r"need each row's reward \(row_reward_B\) or the reward model's"):
        shaped_row_sums(tokens_B)
    with pytest.raises(ValueError, match="overlong_buffer_cfg needs reward_model.enable=false"):
        shaped_row_sums(tokens_B, rm_sum_B=torch.ones(2), overlong_B=torch.zeros(2))


# ------------------------------------------------------------------------------- the collector on a step


class Reads:
    """The collector's `read`: the driver's real read_columns on the local worker group, every name recorded."""

    def __init__(self, group: LocalGroup) -> None:
        self.group, self.names = group, []

    def __call__(self, data, names):
        self.names += list(names)
        return read_columns(self.group, data, names)


def _round(lengths: list[int], scores: list[float], tag: str, seed: int, step_rewards: bool
           ) -> tuple[StepData, Batch]:
    """One generation round as a run holds it (rows on a worker, the rollout's per-row reports on the driver),
    scored as rlsp.step.reward.Reward.score scores a step: rule scores, dapo's penalty, step rewards (if
    `step_rewards`). Groups of two samples. Returns the step and the whole rows for reference."""
    whole = _rows(lengths, seed, tool_only=5)
    if not step_rewards:
        whole.tensors.pop("step_rewards")
    whole.meta["uid"] = [f"{tag}g{i // 2}" for i in range(len(whole))]
    report = row_report(whole, ROLLOUT_REPORTS)
    data = from_results(None, [range(len(whole))], [whole], [report], set(whole.keys()),
                        set(whole.tensors.keys()))
    set_row_scores(data, np.asarray(scores))
    data.set("overlong_reward", overlong_penalties(SHAPING, data))
    derive_shaped_scores(data, step_rewards)
    data.meta["reward_extra_info"] = [{} for _ in scores]
    return data, whole


def _reference(whole: Batch, scores: list[float], step_rewards: bool) -> torch.Tensor:
    """[B, R] the round's token-level scores, built from its whole rows."""
    reward_B = torch.as_tensor(np.asarray(scores), dtype=torch.float32)
    penalty_B = overlong_penalties(SHAPING, whole)
    return shaped_token_scores(whole["response_mask"], reward_B, None, penalty_B,
                               whole["step_rewards"] if step_rewards else None)


@pytest.mark.parametrize("step_rewards", [False, True])
def test_the_collector_filters_on_row_sums_and_reads_no_token_column(step_rewards: bool) -> None:
    group = LocalGroup()
    reads = Reads(group)
    c = GroupCollector("seq_reward", prompts_needed=3, prompts_per_batch=3, max_num_gen_batches=0, read=reads,
                       step_rewards=step_rewards)
    # Penalties (max 8, buffer 4, factor 0.75): 0 up to 4 tokens, -0.375 at 6, -0.75 at 8. Row 5 of each round
    # is tool output only (its token scores are all 0). Round r0: g0 equal (1, 1); g1 0.5 against 0.5 - 0.75
    # (kept for the penalty alone); g2 0 against the tool-only row's 0 (dropped, though its scores are 0 and 1).
    # Round r1: g0 -0.375 against 1; g1 equal (0.5, 0.5); g2 1 - 0.75 against the tool-only row's 0.
    rounds = [([3, 3, 2, 8, 4, 4], [1.0, 1.0, 0.5, 0.5, 0.0, 1.0]), ([6, 4, 2, 2, 8, 5], [0.0, 1.0, 0.5, 0.5, 1.0, 0.0])]
    uids, sums, refs = [], [], []
    for r, (lengths, scores) in enumerate(rounds):
        data, whole = _round(lengths, scores, f"r{r}", seed=10 + r, step_rewards=step_rewards)
        ref_BR = _reference(whole, scores, step_rewards)
        got_B, want_B = seq_rewards(data, step_rewards), ref_BR.sum(-1).double()
        if step_rewards:  # bounded as in test_row_sums_with_step_rewards_equal_the_token_sums_up_to_roundoff
            assert_tensor_close(torch.from_numpy(got_B), want_B, roundoff_rtol(reduction=R + 2, stages=1),
                                value_scale=float(ref_BR.abs().sum(-1).max() + 1.0))
        else:  # the same operations: bit for bit
            assert np.array_equal(got_B, want_B.numpy())
            assert np.array_equal(sample_metric("seq_final_reward", data, np.asarray(scores)), want_B.numpy())
        c.add(data, np.asarray(scores))
        uids += whole.meta["uid"]
        sums.append(want_B)
        refs.append(ref_BR)
    assert group.calls == [] and set(reads.names) <= set(ROW_PARTS)  # nothing came from the workers
    assert c.kept_uids == informative_groups(uids, torch.cat(sums).numpy())[0]  # as the token sums filter
    if not step_rewards:
        assert c.kept_uids == ["r0g1", "r1g0", "r1g2"] and c.filtered == 3
    batch, _ = c.take()
    assert group.calls == [] and "token_level_scores" not in batch.table  # still per-row values only
    # The kept rows build their token-level scores when read (the joined builds of both rounds), every element
    # equal to those built from the whole rows.
    read_columns(group, batch, ["token_level_scores"])
    assert group.calls == [{"response_mask"}, {"step_rewards"}] if step_rewards else [{"response_mask"}]
    kept = [i for i, u in enumerate(uids) if u in set(c.kept_uids[:3])]
    assert torch.equal(batch["token_level_scores"], torch.cat(refs)[kept])
