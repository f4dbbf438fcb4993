"""sum_pi_squared (sum over the vocabulary of p^2 per response token, for the optimal token baseline) from the
policy engine's old-logprob pass: at sp=1 it equals the full softmax of the HF model's logits (fp32, within
1e-6, every response token), the logprobs of the same pass equal the plain logprob pass exactly, and Ulysses
(sp 2, 4, with an uneven 6 q / 2 kv head layout), ring and tensor-parallel layouts give the sp=1 values
within 1e-6."""

from __future__ import annotations

import pytest
import torch
from _launch import layout_dims, run_distributed
from test_fsdp_engine import P, _rollout_batch, policy_engine, tolerances
from tolerances import assert_tensor_close
from transformers import AutoModelForCausalLM

from rlsp.data.batch import Batch
from rlsp.models.tiny import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.distributed
TEMPERATURE = 0.7


def _pass(rank: int, world: int, model_path: str, sp: int, ring: int, tp: int, batch: Batch):
    engine = policy_engine(model_path, layout_dims(ulysses=sp, ring=ring, tp=tp), trainable=False)
    both = engine.infer_many(batch, P, 3, ("logprobs", "sum_pi_squared"), temperature=TEMPERATURE,
                             with_sum_pi_squared=True)
    plain = engine.infer(batch, P, 3, "logprobs", temperature=TEMPERATURE)
    return (both, plain) if rank == 0 else None


@pytest.fixture(scope="module")
def model_and_reference(tmp_path_factory):
    spec = TinyModelSpec(hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=2)
    path = build_tiny_model(spec, str(tmp_path_factory.mktemp("m6q2kv")))
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    batch = _rollout_batch(lm.config.vocab_size)
    return path, batch, run_distributed(_pass, 1, path, 1, 1, 1, batch)[0], lm


def test_sp1_equals_the_full_softmax_and_the_plain_logprobs(model_and_reference):
    path, batch, (both, plain), lm = model_and_reference
    ids, attn, mask = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
    expected = torch.zeros_like(mask)
    with torch.no_grad():
        for b in range(len(batch)):  # one unpadded sequence at a time through the plain HF model
            keep = attn[b].bool()
            logits = lm(ids[b][keep][None]).logits[0].double() / TEMPERATURE
            p = torch.softmax(logits, -1)
            first = int(P - attn[b, :P].sum())  # the kept sequence starts at the first prompt token
            for t in range(int(mask[b].sum())):
                expected[b, t] = (p[P - first + t - 1] ** 2).sum()  # token P+t is predicted at position P+t-1
    assert float(mask.sum()) > 0 and float(expected[mask.bool()].min()) > 0.0
    rtol, _, _ = tolerances(path)  # one fp32 forward against fp64: within the bound of two fp32 ones
    assert_tensor_close(both["sum_pi_squared"], expected, rtol)
    torch.testing.assert_close(both["logprobs"], plain, rtol=0.0, atol=0.0)


@pytest.mark.parametrize("world,sp,ring,tp", [(2, 2, 1, 1), (4, 4, 1, 1), (2, 1, 2, 1), (2, 1, 1, 2)])
def test_layouts_give_the_sp1_values(model_and_reference, world, sp, ring, tp):
    path, batch, (ref, _), _ = model_and_reference
    both, plain = run_distributed(_pass, world, path, sp, ring, tp, batch)[0]
    rtol, _, scale = tolerances(path)
    assert_tensor_close(both["logprobs"], ref["logprobs"], rtol, scale)
    assert_tensor_close(both["sum_pi_squared"], ref["sum_pi_squared"], rtol)
    torch.testing.assert_close(both["logprobs"], plain, rtol=0.0, atol=0.0)
