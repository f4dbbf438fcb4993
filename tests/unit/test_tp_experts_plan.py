"""The planner counts what expert tensor parallelism leaves a tp rank whole (rlsp.plan.memory.tp_replicated).

For every MoE family of tests/tiny_moe.py, with an expert width tp 2 splits (32: rlsp.parallel.tp_experts splits
the routed experts, 16 per rank) and two it does not (36: 18 per rank, not a multiple of ALIGN; 33: odd; the block
runs replicated), the planner's count of a MoE layer's
parameters a tp rank holds whole equals the parameters the layer plan would leave whole on the transformers model:
the router, and the routed experts only when tp does not divide them (`split_expert_block` decides, as
LocalReplicatedMoE does); shared experts whole where tp does not divide them (glm4_moe's at 33). The legal tp sizes stay those of the heads
(an expert width tp does not divide stays legal, replicated). gpt-oss (interleaved gate/up with biases) keeps its
experts whole at any width.
"""

from __future__ import annotations

import pytest
from tiny_moe import EXACT_SHAPE, MOE_FAMILIES, moe_config
from transformers import AutoModelForCausalLM, GptOssConfig

from rlsp.config.layout import RoleLayout, World
from rlsp.config.model_shape import shape_from_config
from rlsp.parallel.tp_experts import SPLIT_EXPERT_FAMILIES, split_expert_block
from rlsp.plan.memory import _routed, tp_replicated

TP2 = RoleLayout(World(1, 2), tp=2)
WIDTH_KEY = {"mixtral": "intermediate_size", "olmoe": "intermediate_size"}  # the others: moe_intermediate_size


def _held_whole(block, model_type: str) -> int:
    """Parameters of a sparse MoE block the layer plan leaves whole at tp 2 (qwen2_moe's [1, h] shared-expert gate,
    which the planner counts as split, left out)."""
    split = split_expert_block(block, model_type, 2)
    shared = next((getattr(block, n) for n in ("shared_expert", "shared_experts") if hasattr(block, n)), None)
    shared_whole = shared is not None and shared.gate_proj.out_features % 2 != 0  # else split like an MLP
    return sum(p.numel() for n, p in block.named_parameters()
               if n.startswith("gate.") or (n.startswith("experts.") and not split)
               or (n.startswith("shared_expert") and not n.startswith("shared_expert_gate") and shared_whole))


@pytest.mark.parametrize("width", [32, 36, 33], ids=["split", "unaligned", "odd"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_planner_counts_split_experts_at_one_tp_share(family, width):
    config = moe_config(family, **EXACT_SHAPE, **{WIDTH_KEY.get(family, "moe_intermediate_size"): width})
    model = AutoModelForCausalLM.from_config(config)
    shape = shape_from_config(config.to_dict(), family)
    layer = len(shape.kinds) - 1  # the last layer is sparse in every family (glm4_moe's first is dense)
    block = model.model.layers[layer].mlp
    assert split_expert_block(block, config.model_type, 2) == (width == 32)
    assert tp_replicated(shape, shape.kinds[layer], TP2) == _held_whole(block, config.model_type)
    assert 2 in shape.legal_tp()


def test_gpt_oss_keeps_its_experts_whole():
    config = GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=4, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=64)
    shape = shape_from_config(config.to_dict(), "gpt_oss")
    kind = shape.kinds[0]
    assert "gpt_oss" not in SPLIT_EXPERT_FAMILIES
    assert tp_replicated(shape, kind, TP2) == _routed(shape, kind) + shape.hidden * kind.mlp.experts
