"""ReMax's greedy pass reads none of the samples' worker-held columns: its prompts are the rows the step sent to
the engines (rlsp.trainer.rollout_inputs.StepPrompts, picked by the samples' uids) and the greedy rows' lengths are
the rollout's per-row report. Compared with the former computation (the prompts cut from the samples' token
columns, read to the driver, and the greedy rows' response_mask read for the length metric): the same prompts
(every field the former sent, in the same order and padding), bit-equal `reward_baselines` of the same dtype and
the same metrics; the images of a vision-language prompt now travel too (the former dropped them).

A step is held as a run holds it: the rows in blocks (here the Batches themselves), the rollout's reports on the
driver, so indexing any other column on the driver raises ColumnNotRead. The greedy engine is a deterministic
function of the prompt, the reward model a deterministic function of the rows that runs where a worker does (on
the rows `assemble` builds from the blocks) and reports per row as the reward-model role declares; the reward path
itself is the trainer's `Reward`.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from test_step_reads import LocalGroup

from rlsp.config.schema import RLSPConfig
from rlsp.controller.reads import read_columns
from rlsp.controller.reward_workers import ScoringPool
from rlsp.controller.step_data import StepData, from_results
from rlsp.data.batch import Batch
from rlsp.step.baselines import BASELINE_DTYPE, add_greedy_baselines
from rlsp.step.reward import Reward
from rlsp.trainer.rollout_inputs import StepPrompts, prompt_batch
from rlsp.workers.columns import assemble, row_report
from rlsp.workers.dispatch import declared_fields
from rlsp.workers.roles.reward_model import RewardModelRole, place_on_last_token
from rlsp.workers.roles.rollout import ROLLOUT_REPORTS
from rlsp.workers.rollout_rows import build_rollout_rows

P, R, N = 6, 5, 2  # prompt width, response width, samples per prompt
RM = declared_fields(RewardModelRole, "compute_rm_score")
# The prompt fields the former computation took from the samples' meta (HEAD's rlsp.step.baselines.PROMPT_META).
FORMER_META = ("uid", "data_source", "ground_truth", "extra_info", "index", "messages", "agent_name")


class Held(Batch):
    """A block as the driver holds it: in a run an object reference, equal only to itself."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__


def _held(batch: Batch) -> Held:
    return Held(batch.tensors, batch.meta, batch.info)


def _items(first: int, n: int, images: bool) -> list[dict]:
    """Dataset items of prompts of 1..P tokens; with `images`, every other one carries an image."""
    items = []
    for k in range(first, first + n):
        item = {"prompt_ids": [(7 * k + j) % 50 + 1 for j in range(1 + k % P)], "data_source": f"d{k % 2}",
                "ground_truth": str(k), "extra_info": {"k": k}, "index": k, "messages": [{"content": f"q{k}"}]}
        if images and k % 2:
            item.update(multi_modal_inputs={"pixel_values": torch.full((2, 3), float(k))}, images=[f"png{k}".encode()])
        items.append(item)
    return items


def _engine(prompts: Batch, n: int, greedy: bool) -> StepData:
    """What RolloutRole.generate returns for `prompts` (n samples each, contiguous, the prompt's meta but its
    ids), held as a run holds it: the rows in a block, the rollout's per-row reports on the driver. Greedy: one
    response per prompt, a function of its ids; else n responses of pseudo-random lengths (0 included)."""
    g = torch.Generator().manual_seed(int(prompts["prompt_index"][0]))
    source = [i for i in range(len(prompts)) for _ in range(n)]
    ids = [prompts.meta["prompt_ids"][i] for i in source]
    lengths = [sum(p) % (R + 1) if greedy else int(torch.randint(0, R + 1, (1,), generator=g)) for p in ids]
    responses = [[(sum(p) + j) % 50 for j in range(m)] for p, m in zip(ids, lengths)]
    rows = build_rollout_rows(ids, responses, [[0.0] * m for m in lengths], P, R, 0)
    meta = {k: [v[i] for i in source] for k, v in prompts.meta.items() if k != "prompt_ids"}
    whole = Batch.from_dict(rows, meta=meta)
    return from_results(None, [range(len(whole))], [_held(whole)], [row_report(whole, ROLLOUT_REPORTS)], set(whole.keys()),
                        set(whole.tensors.keys()))


def _reward_model(rows: StepData) -> StepData:
    """A reward model's call as the workers answer it: the rows it declares, built from the blocks; its scores
    (on the last response token) stay in a block, the driver gets the reports the role declares."""
    spec, blocks = rows.spec(range(len(rows)), RM.reads)
    whole = assemble(spec, blocks)
    attended = (whole["input_ids"] * whole["attention_mask"]).sum(-1)
    out = Batch.from_dict({"rm_scores": place_on_last_token((attended % 7).double() / 3, whole["response_mask"])})
    return from_results(rows, [range(len(rows))], [_held(out)], [row_report(whole.update(out), RM.reports)], RM.writes,
                        RM.writes)


class Greedy:
    """The trainer's greedy `generate`: the engine above, every prompt batch it was sent recorded."""

    def __init__(self) -> None:
        self.sent: list[Batch] = []

    def __call__(self, prompts: Batch) -> StepData:
        self.sent.append(prompts)
        return _engine(prompts, 1, greedy=True)


def _step(images: bool) -> tuple[StepData, StepPrompts]:
    """Two generation rounds of 3 prompts (as dynamic sampling collects them), one group of the second dropped,
    the rows then reordered (balance_batch); the prompt rows the trainer kept for the step."""
    kept, parts = StepPrompts(), []
    for r in range(2):
        prompts = prompt_batch(_items(3 * r, 3, images and r == 1), [f"r{r}p{k}" for k in range(3)])
        prompts.set("prompt_index", torch.arange(3 * r, 3 * r + 3))
        kept.add(prompts)
        parts.append(_engine(prompts, N, greedy=False))
    parts[1] = parts[1].select_rows([0, 1, 4, 5])  # r1p1 filtered out
    return StepData.concat(parts).select_rows([6, 0, 3, 9, 1, 4, 8, 2, 5, 7]), kept


def _former(samples: StepData, group: LocalGroup, reward: Reward, world_size: int) -> tuple[Greedy, torch.Tensor, dict]:
    """HEAD's computation: the samples' token columns and prompt fields read to the driver, the prompts cut from
    the left-padded prompt columns, the greedy rows' response_mask read for their lengths and the dtype."""
    batch = read_columns(group, samples.copy(), ("input_ids", "attention_mask", "response_mask", *FORMER_META))
    first: dict[str, int] = {}
    for row, uid in enumerate(batch.meta["uid"]):
        first.setdefault(uid, row)
    rows = list(first.values())
    real = len(rows)
    rows += rows[: (-real) % world_size]
    width = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
    ids, attended = batch["input_ids"][:, :width], batch["attention_mask"][:, :width].bool()
    meta = {k: [batch.meta[k][r] for r in rows] for k in FORMER_META if k in batch.meta}
    meta["prompt_ids"] = [ids[r][attended[r]].tolist() for r in rows]
    generate = Greedy()
    greedy = read_columns(group, generate(Batch.from_dict({"prompt_index": torch.arange(len(rows))}, meta=meta))
                          .select_rows(slice(0, real)), ["response_mask"])
    scores = reward.score(greedy)
    by_uid = dict(zip(greedy.meta["uid"], scores.tolist()))
    baselines = torch.tensor([by_uid[uid] for uid in batch.meta["uid"]], dtype=batch["response_mask"].dtype)
    return generate, baselines, {"reward/baseline_mean": float(scores.mean()),
                                 "reward/baseline_response_length_mean": float(greedy["response_mask"].sum(-1).double().mean())}


@pytest.mark.parametrize("images", [False, True])
@pytest.mark.parametrize("world_size", [1, 4])
def test_greedy_baselines_equal_the_former_computation_and_read_no_column(images: bool, world_size: int) -> None:
    reward = Reward(OmegaConf.structured(RLSPConfig), ScoringPool([LocalGroup()]), _reward_model)
    samples, kept = _step(images)
    reported = set(samples.table.meta) | set(samples.table.tensors.keys())
    group = LocalGroup()
    greedy, timing = Greedy(), {}
    metrics = add_greedy_baselines(greedy, world_size, reward, samples, kept.rows(), timing)
    assert group.calls == [] and set(timing) == {"timing/gen_baseline_s", "timing/reward_baseline_s"}
    assert set(samples.table.meta) | set(samples.table.tensors.keys()) == reported | {"reward_baselines"}

    former, want_B, want_metrics = _former(samples, group, reward, world_size)
    assert {"input_ids", "attention_mask", "response_mask"} <= set().union(*group.calls)  # what it read
    (sent,), (sent_before,) = greedy.sent, former.sent
    assert len(sent) == len(sent_before) == 5 + (-5) % world_size  # five prompts kept, padded to the world
    for key in (*FORMER_META, "prompt_ids"):
        assert sent.meta[key] == sent_before.meta[key], key
    assert torch.equal(sent["prompt_index"], sent_before["prompt_index"])
    assert torch.equal(samples["reward_baselines"], want_B) and want_B.dtype == BASELINE_DTYPE
    assert metrics == want_metrics
    if images:  # the second round's image rows (r1p0 and r1p2: items 3 and 5) with their images, the rest none
        by_uid = dict(zip(sent.meta["uid"], zip(sent.meta["multi_modal_inputs"], sent.meta["images"])))
        assert by_uid["r1p0"][1] == [b"png3"] and by_uid["r1p2"][1] == [b"png5"]
        assert torch.equal(by_uid["r1p0"][0]["pixel_values"], torch.full((2, 3), 3.0))
        assert by_uid["r0p0"] == by_uid["r0p1"] == by_uid["r0p2"] == (None, [])  # a text-only round: filled
        assert "multi_modal_inputs" not in sent_before.meta  # the former pass sent the image placeholders alone
    else:
        assert "multi_modal_inputs" not in sent.meta


def test_a_sample_without_a_kept_prompt_row_is_refused_by_uid() -> None:
    samples, _ = _step(images=False)
    only_first = StepPrompts()
    only_first.add(prompt_batch(_items(0, 3, False), [f"r0p{k}" for k in range(3)]))
    reward = Reward(OmegaConf.structured(RLSPConfig), ScoringPool([LocalGroup()]), _reward_model)
    with pytest.raises(RuntimeError, match=r"no prompt row kept for the samples of uid\(s\) \['r1p0', 'r1p2'\] \(the step sent 3 prompts\)"):
        add_greedy_baselines(Greedy(), 2, reward, samples, only_first.rows(), {})
    with pytest.raises(RuntimeError, match="no prompt rows were kept for this step"):
        StepPrompts().rows()


def test_the_baseline_dtype_is_the_rollout_masks() -> None:
    rows = build_rollout_rows([[1, 2]], [[3]], [[0.0]], 2, 2, 0, response_masks=[[1]])
    assert rows["response_mask"].dtype == BASELINE_DTYPE
    assert build_rollout_rows([[1]], [[]], [[]], 2, 2, 0)["response_mask"].dtype == BASELINE_DTYPE
