"""Every registered estimator, run by the step stage (rlsp.workers.step_stage), with KL in the reward, on two
data-parallel ranks against the driver's one-process computation, every element; once on the rows' scores
alone and once with dapo's overlong penalty and tool step rewards, which the stage adds to the scores itself
from the per-row penalty and the step-reward column (the driver built them in place before).

The rows' groups are interleaved (a prompt's samples are not next to each other, as after balancing), so the
driver's group-aligned cut (rlsp.step.stage_advantages.group_aligned_order) has to reorder them; each rank
runs `run_step_stage` on its shard with the reduction `ActorRole.compute_advantages` gives it (`dp_sum`), and the
shards, put back in the step's row order, are compared with `apply_kl_penalty` then `compute_advantages` on the
whole batch:

- estimators whose statistics are per row or per group (GRPO, RLOO, OPO, pass@k, ReMax, the optimal token
  baselines) and GPG (its batch-wide statistic is a count of rows) bit for bit: a group's rows are summed in
  the same order on its shard;
- whitening estimators (GAE, REINFORCE++ and its baseline variant, GDPO with its reward components sent as one
  float per row each) within the rounding of the two batch-wide sums taken in another order
  (tests/tolerances.py, derivation 1), scaled by the whitened values' size.

Masks have holes, one row has no response token; the per-row sums the driver's metrics read are checked too.
"""

from __future__ import annotations

import pytest
import torch
from _launch import layout_dims, run_distributed
from tolerances import assert_tensor_close, roundoff_rtol

from rlsp.algos.adv_columns import INPUT_COLUMNS
from rlsp.algos.adv_inputs import AdvantageInputs
from rlsp.algos.aggregation import group_mean_std, masked_sum
from rlsp.algos.kl_ctrl import apply_kl_penalty, batch_kl
from rlsp.algos.registry import compute_advantages, estimator_uses, list_adv_estimators
from rlsp.data.batch import Batch
from rlsp.rewards.overlong import OverlongShaping, compute_overlong_penalty
from rlsp.rewards.scoring import place_scores
from rlsp.step.stage_advantages import group_aligned_order
from rlsp.workers.step_stage import STAGE_READS, StageRequest, dp_sum, run_step_stage

pytestmark = pytest.mark.distributed

B, R, GROUPS = 12, 9, 4
SETTINGS = {"gae": {"gamma": 0.99, "lam": 0.95}, "reinforce_plus_plus": {"gamma": 0.9},
            "grpo_passk": {"norm_adv_by_std": False}, "gdpo": {"gdpo_reward_weights": (1.0, 0.5)}}
WHITENING = ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gdpo")
COMPONENTS = ("acc", "fmt")  # gdpo's named reward components: one float per row each (column reward_components)
SHAPED = ("overlong_reward", "step_rewards")  # per-row penalty, step rewards: what the stage adds to the scores
UIDS = [f"p{i % GROUPS}" for i in range(B)]  # interleaved groups of 3


SHAPING = OverlongShaping(max_resp_len=R, buffer_len=4, penalty_factor=0.5)


def _request(name: str, shaped: bool) -> StageRequest:
    return StageRequest(name, SETTINGS.get(name, {}), kl_coef=0.05, kl_kind="low_var_kl", step_rewards=shaped,
                        components=COMPONENTS if "reward_components" in estimator_uses(name) else ())


def _batch() -> Batch:
    gen = torch.Generator().manual_seed(5)
    mask = (torch.rand(B, R, generator=gen) > 0.2).float()
    mask[:, 0] = 1
    mask[:, R - 2:] = 0
    mask[7] = 0  # no response token
    scores = torch.randint(0, 3, (B,), generator=gen).float() + (torch.rand(B, generator=gen) > 0.5).float() * 0.5
    old = -torch.rand(B, R, generator=gen) * 3
    return Batch.from_dict({
        "response_mask": mask, "row_reward": scores, "old_logprobs": old,
        "ref_logprobs": -torch.rand(B, R, generator=gen) * 3, "values": torch.randn(B, R, generator=gen) * mask,
        "reward_baselines": torch.rand(B, generator=gen),
        "sum_pi_squared": old.exp() ** 2 + torch.rand(B, R, generator=gen) * 0.1,
        "step_rewards": (torch.rand(B, R, generator=gen) > 0.8).float() * 0.25,
        "overlong_reward": compute_overlong_penalty(mask.sum(-1), R, 4, 0.5),
        "reward_components": torch.stack([torch.randint(0, 2, (B,), generator=gen).double(),
                                          torch.rand(B, generator=gen).double()], dim=-1)}, meta={"uid": UIDS})


def _stage_worker(rank: int, world: int) -> dict[tuple[str, bool], dict[str, torch.Tensor]]:
    dims = layout_dims()
    order, per = group_aligned_order(UIDS, dims.dp_size), B // dims.dp_size
    full = _batch()
    rows = full.select_rows(order[dims.dp_rank * per:(dims.dp_rank + 1) * per])
    reduce = dp_sum(dims.dp_group)  # what ActorRole.compute_advantages passes
    out = {}
    for shaped in (False, True):  # the rows' scores alone, or with the overlong penalty and step rewards
        keys = [k for k in STAGE_READS if k in rows.tensors.keys() and (shaped or k not in SHAPED)]
        shard = Batch.from_dict({k: rows[k] for k in keys}, meta={"uid": rows.meta["uid"]})
        for name in list_adv_estimators():
            result = run_step_stage(shard, _request(name, shaped), reduce)
            out[name, shaped] = {k: result[k] for k in result.keys()}
    return out


def _scores(full: Batch, shaped: bool) -> torch.Tensor:
    """The driver's token scores: the row's reward on its last policy token, then (shaped) dapo's shaping in
    place (`OverlongShaping.apply`) and the step rewards added (rlsp.step.reward's former steps)."""
    mask = full["response_mask"]
    rows = Batch.from_dict({"response_mask": mask, "token_level_scores": place_scores(full["row_reward"].tolist(), mask)})
    if not shaped:
        return rows["token_level_scores"]
    SHAPING.apply(rows)
    return rows["token_level_scores"] + full["step_rewards"] * mask


def _reference(name: str, shaped: bool) -> dict[str, torch.Tensor]:
    """What the driver computes on the whole batch."""
    full, request = _batch(), _request(name, shaped)
    mask = full["response_mask"]
    rewards, current_kl = apply_kl_penalty(_scores(full, shaped), full["old_logprobs"],
                                           full["ref_logprobs"], mask, request.kl_coef, request.kl_kind)
    extra = {f: full[k] for f, (k, _) in INPUT_COLUMNS.items() if f in estimator_uses(name) and k in full}
    if "reward_components" in estimator_uses(name):
        extra["reward_components"] = dict(zip(COMPONENTS, full["reward_components"].unbind(-1)))
    adv, ret = compute_advantages(name, AdvantageInputs(rewards, mask, UIDS, **request.settings, **extra))
    return {"token_level_rewards": rewards, "current_kl": current_kl, "advantages": adv, "returns": ret}


def _gdpo_sum() -> torch.Tensor:
    """What gdpo whitens: the weighted sum of each component normalised within its group, on every response token."""
    full, (w_acc, w_fmt) = _batch(), SETTINGS["gdpo"]["gdpo_reward_weights"]
    total = torch.zeros(B, dtype=torch.float64)
    for values, weight in zip(full["reward_components"].unbind(-1), (w_acc, w_fmt)):
        mean, std, _ = group_mean_std(values, UIDS)
        total += weight * (values - mean) / (std + 1e-6)
    return total.unsqueeze(-1) * full["response_mask"]


def test_group_aligned_order_keeps_groups_whole():
    order = group_aligned_order(UIDS, 2)
    assert sorted(order) == list(range(B))
    shards = [{UIDS[r] for r in order[:6]}, {UIDS[r] for r in order[6:]}]
    assert not shards[0] & shards[1] and all(len(s) == 2 for s in shards)
    assert all(order.index(a) < order.index(b) for a in range(B) for b in range(a + 1, B) if UIDS[a] == UIDS[b])
    assert group_aligned_order(UIDS, 3) is None  # 4 rows a chunk: no group of 3 fits beside another
    assert group_aligned_order(UIDS, 5) is None  # 12 rows do not split into 5 equal chunks
    assert group_aligned_order(["a", "b", "b", "a", "c", "c", "c", "d"], 2) == [4, 5, 6, 7, 0, 3, 1, 2]
    # Why the cut matters: the step's first half as a shard splits every group, and GRPO's values change.
    half = _batch().select_rows(list(range(B // 2)))
    shard = Batch.from_dict({k: half[k] for k in ("row_reward", "response_mask")}, meta={"uid": half.meta["uid"]})
    split = run_step_stage(shard, StageRequest("grpo"), None)["advantages"]
    whole = compute_advantages("grpo", AdvantageInputs(_scores(_batch(), False), _batch()["response_mask"], UIDS))[0]
    assert not torch.equal(split, whole[: B // 2])


def test_every_stage_estimator_with_kl_on_dp_shards_equals_the_driver():
    assert set(list_adv_estimators()) >= {"grpo", "rloo", "gpg", "opo", "grpo_passk", "remax", "gae",
                                          "reinforce_plus_plus", "reinforce_plus_plus_baseline", "optimal_token_baseline",
                                          "tir_optimal_token_baseline", "grpo_vectorized", "rloo_vectorized", "gdpo"}
    results = run_distributed(_stage_worker, 2)
    order = group_aligned_order(UIDS, 2)
    back = sorted(range(B), key=order.__getitem__)
    mask = _batch()["response_mask"]
    assert not torch.equal(_scores(_batch(), True), _scores(_batch(), False))  # the shaping changes the scores
    for name, shaped in results[0]:
        got = {k: torch.cat([r[name, shaped][k] for r in results])[back] for k in results[0][name, shaped]}
        ref = _reference(name, shaped)
        assert torch.equal(got["token_level_rewards"], ref["token_level_rewards"]), name
        assert batch_kl(got["reward_kl"]) == ref["current_kl"], name  # the adaptive controller's input
        if name not in WHITENING:
            assert torch.equal(got["advantages"], ref["advantages"]), name
            assert torch.equal(got["returns"], ref["returns"]), name
            assert torch.equal(got["advantages_sum"], masked_sum(ref["advantages"], mask, dim=-1)), name
            continue
        if name == "gdpo":  # its returns are the whitened advantages; it whitens the weighted components' sum
            raw = _gdpo_sum()
            assert torch.equal(got["returns"], got["advantages"]) and torch.equal(ref["returns"], ref["advantages"])
        else:
            assert torch.equal(got["returns"], ref["returns"]), name  # per row: any cut gives the same
            raw = ref["returns"] - (_batch()["values"] if name == "gae" else 0)  # what was whitened
        std = float(raw[mask.bool()].std())
        rtol = roundoff_rtol(reduction=int(mask.sum()), stages=2)  # the mean's sum, the variance's sum
        assert_tensor_close(got["advantages"], ref["advantages"], rtol,
                            value_scale=float(raw[mask.bool()].abs().max()) / std + float(ref["advantages"].abs().max()))
        assert torch.equal(got["advantages"] == 0, (mask == 0) | (ref["advantages"] == 0)), name
