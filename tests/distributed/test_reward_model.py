"""The reward model's scores through rlsp's engine equal transformers' own sequence classifier.

Reference: `AutoModelForSequenceClassification` in fp64 (eager attention), one unpadded row at a time,
its pooled logit (the score at the last token). rlsp: the same checkpoint as `RewardModel` in the
FSDP2 engine (fp32), packed micro-batches, the score read at each row's last real token — at one rank,
at Ulysses 2 (the sequence split over two ranks) and at dp 2, with fixed-size and token-budget
micro-batches. Every row's score within the bound tests/tolerances.py derives; the sharded self-check
agrees; the score lands on the last response token.
"""

from __future__ import annotations

import pytest
import torch
from _launch import layout_dims, run_distributed
from test_fsdp_engine import P, _rollout_batch, tolerances
from tolerances import assert_tensor_close, scalar_tol
from transformers import AutoConfig, AutoModelForSequenceClassification

from rlsp.engine.fsdp_engine import FSDPEngine
from rlsp.models.reward import RewardModel, load_reward_model
from rlsp.models.tiny import TinyModelSpec, build_tiny_reward_model
from rlsp.workers.roles.reward_model import place_on_last_token

pytestmark = pytest.mark.distributed


def _scores(rank: int, world: int, path: str, batch, ulysses: int, micro: int, max_tokens: int | None):
    dims = layout_dims(ulysses=ulysses)
    engine = FSDPEngine(RewardModel(load_reward_model(path)), dims, torch.device("cpu"))
    shard = batch.chunk(dims.dp_size)[dims.dp_rank]
    scores = engine.infer(shard, P, micro, "scores", max_tokens, last_token=True)
    check = engine.sp_self_check(shard, shard["input_ids"].shape[1], "scores", last_token=True)
    return scores, check, dims.dp_rank, dims.coords.ulysses


def _reference(path: str, batch) -> torch.Tensor:
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float64, attn_implementation="eager")
    out = []
    with torch.no_grad():
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
            out.append(model(ids[mask.bool()][None]).logits[0, 0])
    return torch.stack(out)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = build_tiny_reward_model(TinyModelSpec(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                                 num_key_value_heads=2, init_std=0.3),
                                   str(tmp_path_factory.mktemp("rm") / "rm"))
    batch = _rollout_batch(AutoConfig.from_pretrained(path).vocab_size)
    return path, batch, _reference(path, batch)


@pytest.mark.parametrize("world,ulysses,micro,max_tokens", [(1, 1, 3, None), (2, 2, 3, None), (2, 2, 8, 20),
                                                             (2, 1, 2, None), (4, 2, 1, None)])
def test_scores_equal_transformers_sequence_classifier(setup, world, ulysses, micro, max_tokens):
    path, batch, ref = setup
    assert float(ref.abs().min()) > 1e-3 and float(ref.std()) > 1e-2  # real, distinct scores
    results = run_distributed(_scores, world, path, batch, ulysses, micro, max_tokens)
    dp = world // ulysses
    got = torch.cat([next(r[0] for r in results if r[2] == g and r[3] == 0) for g in range(dp)])
    rtol, _, _ = tolerances(path)  # one fp32 forward against fp64: within the bound of two fp32 ones
    assert_tensor_close(got, ref, rtol)
    tol = scalar_tol(float(ref.abs().max()), rtol)
    assert all(r[1] <= tol for r in results)  # sharded vs unsharded forward of every rank


def test_score_lands_on_the_last_response_token():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    out = place_on_last_token(torch.tensor([0.5, -2.0, 3.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.5, 0.0], [0.0, 0.0, -2.0], [0.0, 0.0, 0.0]]))
