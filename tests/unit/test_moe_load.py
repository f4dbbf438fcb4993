"""Expert load counts (rlsp/engine/moe_load.py) against transformers' own router outputs.

On a tiny model of each plain MoE family (tests/tiny_moe.py, the exactness matrix's shape) the tokens per expert the
router hooks count over a padded batch's real tokens equal a direct count of the top-k of the router logits that
transformers returns (`output_router_logits=True`); forwards outside `counting` (a checkpointed layer's recomputation)
add nothing; the metrics follow from the counts; a dense model has no router and reports nothing.
"""

from __future__ import annotations

import pytest
import torch
from tiny_moe import EXACT_SHAPE, MOE_FAMILIES, moe_config
from transformers import AutoModelForCausalLM, LlamaConfig

from rlsp.engine.moe_load import PREFIX, ExpertLoad, compute_load_metrics


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    mask[2, 6:] = 0  # right padding
    return input_ids, mask


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_counts_equal_top_k_of_transformers_router_logits(family):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(moe_config(family, **EXACT_SHAPE), dtype=torch.float32).eval()
    load = ExpertLoad(model)
    input_ids, mask = _batch(model.config.vocab_size)
    with torch.no_grad(), load.counting(mask.reshape(-1).bool()):
        out = model(input_ids=input_ids, attention_mask=mask, output_router_logits=True)
    with torch.no_grad():
        model(input_ids=input_ids, attention_mask=mask)  # outside `counting`: not counted
    k, real = model.config.num_experts_per_tok, mask.reshape(-1).bool()
    assert len(out.router_logits) == len(load.layer_ids) > 0
    for row, logits_NE in enumerate(out.router_logits):
        top_NK = logits_NE.float()[real].topk(k + 1, dim=-1)
        # every family ranks experts by a monotone function of the logits; no token within fp32 roundoff of a tie
        assert float((top_NK.values[:, k - 1] - top_NK.values[:, k]).min()) > 1e-5
        expected_E = torch.bincount(top_NK.indices[:, :k].reshape(-1), minlength=logits_NE.shape[-1]).double()
        assert torch.equal(load.counts_LE[row], expected_E), (family, row, load.counts_LE[row], expected_E)
    assert int(load.counts_LE.sum()) == len(load.layer_ids) * k * int(mask.sum())
    expected = compute_load_metrics(load.counts_LE.clone(), load.num_experts, load.layer_ids)
    assert load.reduce(per_layer=True) == expected and not load.counts_LE.any()  # reduce resets the counts
    first_moe = model.config.first_k_dense_replace if family == "glm4_moe" else 0
    assert load.layer_ids == list(range(first_moe, model.config.num_hidden_layers))


def test_load_metrics_from_counts():
    counts_LE = torch.tensor([[6.0, 0.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    got = compute_load_metrics(counts_LE, [4, 4, 4], [1, 2, 3])
    assert got == {PREFIX + "load_max_over_mean": 3.0, PREFIX + "unused_expert_share": 0.125,
                   PREFIX + "layer_1/load_max_over_mean": 3.0, PREFIX + "layer_1/unused_expert_share": 0.25,
                   PREFIX + "layer_2/load_max_over_mean": 1.0, PREFIX + "layer_2/unused_expert_share": 0.0}
    assert compute_load_metrics(counts_LE[2:], [4]) == {}  # no token routed: nothing to report


def test_dense_model_reports_nothing():
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    load = ExpertLoad(AutoModelForCausalLM.from_config(config))
    assert not load.enabled and load.reduce(per_layer=True) == {}
