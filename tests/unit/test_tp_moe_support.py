"""Which MoE models rlsp's tensor parallelism takes (rlsp.parallel.tp_checks, the layer plan of tp_families).

The five MoE families of tests/tiny_moe.py pass the start-up checks (rlsp.check's `check_tp_windowed` and
`check_tp_support`) at tp 2; their sparse blocks run replicated over tp, so only the heads and the dense layers'
intermediate_size must divide (a MoE block's expert width need not). MoE families tp does not split stay refused by
name. Exactness of the MLA and Gated DeltaNet MoE families: test_tp_mla_exact.py, test_tp_linear_exact.py. Exactness itself:
tests/distributed/test_tp_moe_exact.py.
"""

from __future__ import annotations

import pytest
import torch
from tiny_moe import EXACT_SHAPE, MOE_FAMILIES, moe_config
from transformers import AutoModelForCausalLM, PhimoeConfig

from rlsp.models.family_checks import check_tp_windowed
from rlsp.parallel.tp_checks import check_tp_support, legal_tp_sizes
from rlsp.parallel.tp_families import (
    HeadShardedNorm,
    ProjectionShardedNorm,
    qk_norm_plan,
    sparse_moe_block,
)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_moe_families_pass_the_start_up_checks_at_tp2(family):
    config = moe_config(family, **EXACT_SHAPE)
    check_tp_windowed(config, 2)
    check_tp_support(config, 2)
    assert legal_tp_sizes(config) == [1, 2]  # 6 q / 2 kv heads


@pytest.mark.parametrize("family,dense", [("mixtral", {}), ("olmoe", {}), ("qwen3_moe", {}),
                                          ("glm4_moe", dict(first_k_dense_replace=0))])
def test_an_expert_width_tp_does_not_divide_is_legal(family, dense):
    """intermediate_size 63 is mixtral's / olmoe's expert width; a qwen3_moe or glm4_moe without dense layers
    never builds an MLP of that width: every block replicated over tp."""
    config = moe_config(family, **EXACT_SHAPE, intermediate_size=63, moe_intermediate_size=33, **dense)
    check_tp_support(config, 2)
    assert legal_tp_sizes(config) == [1, 2]


@pytest.mark.parametrize("family,dense", [("glm4_moe", dict(first_k_dense_replace=1)),
                                          ("qwen3_moe", dict(mlp_only_layers=[1])),
                                          ("qwen2_moe", dict(decoder_sparse_step=2))])
def test_dense_layers_of_a_moe_family_need_an_even_intermediate_size(family, dense):
    config = moe_config(family, **EXACT_SHAPE, intermediate_size=63, **dense)
    check_tp_support(config, 1)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=2 does not divide 6 q heads / 2 kv heads / "
                                         r"intermediate_size 63; legal tensor_model_parallel_size for this model: 1$"):
        check_tp_support(config, 2)


def test_odd_heads_are_refused_with_the_legal_sizes():
    with pytest.raises(ValueError, match=r"=4 does not divide 6 q heads / 2 kv heads \(every MLP a MoE block, "
                                         r"replicated over tp\); legal tensor_model_parallel_size for this model: 1, 2"):
        check_tp_support(moe_config("mixtral", **EXACT_SHAPE), 4)


def test_other_moe_families_stay_refused_by_name():
    phimoe = PhimoeConfig(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, num_local_experts=4)
    check_tp_support(phimoe, 1)
    with pytest.raises(ValueError, match=r"=2: phimoe has mixture-of-experts layers \(num_local_experts=4\); .*"
                                         r"'qwen3_moe', 'mixtral', 'olmoe', 'glm4_moe', .*\] only.*legal: 1"):
        check_tp_support(phimoe, 2)


def test_the_layer_plan_tells_sparse_blocks_from_dense_layers_and_picks_the_norms():
    """glm4_moe (use_qk_norm): a dense first layer, then a sparse block; per-head q/k norms. olmoe: whole-projection
    norms. qwen3_moe: per-head norms. mixtral: none. A family outside the lists gets no entries (its norms'
    plain parameters then fail apply_tensor_parallel's check by name)."""
    torch.manual_seed(0)
    glm = AutoModelForCausalLM.from_config(moe_config("glm4_moe", **EXACT_SHAPE, use_qk_norm=True)).model
    assert [sparse_moe_block(layer.mlp, "glm4_moe") for layer in glm.layers] == [False, True]
    assert not sparse_moe_block(glm.layers[1].mlp, "phimoe")
    assert {type(s) for s in qk_norm_plan(glm.layers[0].self_attn, "glm4_moe").values()} == {HeadShardedNorm}
    for family, style in (("olmoe", ProjectionShardedNorm), ("qwen3_moe", HeadShardedNorm)):
        attn = AutoModelForCausalLM.from_config(moe_config(family, **EXACT_SHAPE)).model.layers[0].self_attn
        assert {type(s) for s in qk_norm_plan(attn, family).values()} == {style}
        assert set(qk_norm_plan(attn, family)) == {"self_attn.q_norm", "self_attn.k_norm"}
        assert qk_norm_plan(attn, "some_other_family") == {}
    mixtral = AutoModelForCausalLM.from_config(moe_config("mixtral", **EXACT_SHAPE)).model
    assert qk_norm_plan(mixtral.layers[0].self_attn, "mixtral") == {}


def test_projection_sharded_norm_refuses_another_norm_by_name():
    with pytest.raises(ValueError, match=r"RMSNorm is not an RMSNorm with one weight and `variance_epsilon`"):
        ProjectionShardedNorm()._apply(torch.nn.RMSNorm(8), None)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "glm4_moe"])
def test_the_planner_counts_moe_blocks_whole_on_every_tp_rank(family):
    """The planner's parameters per rank at tp 2 (one FSDP rank) equal what the layer plan leaves a tp rank of the
    transformers model: its sparse blocks' router whole, the routed experts halved where rlsp.parallel.tp_experts
    splits them (all four here), else whole, the rest of a layer (glm4_moe's shared experts included) halved, the
    embedding, lm_head and final norm whole."""
    from rlsp.config.layout import RoleLayout, World
    from rlsp.config.model_shape import shape_from_config
    from rlsp.parallel.tp_experts import split_expert_block
    from rlsp.plan.memory import state_bytes

    config = moe_config(family, **EXACT_SHAPE)
    model = AutoModelForCausalLM.from_config(config).model
    per_rank = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("layers."))
    per_rank += config.vocab_size * config.hidden_size  # the untied lm_head
    for layer in model.layers:
        whole = sparse_moe_block(layer.mlp, family)
        split = whole and split_expert_block(layer.mlp, family, 2)  # routed experts split over tp
        per_rank += sum(p.numel() / (1 if whole and n.startswith("mlp.") and ".shared_experts." not in n
                                     and not (split and ".experts." in n) else 2)
                        for n, p in layer.named_parameters())
    shape = shape_from_config(config.to_dict(), family)
    assert state_bytes(shape, RoleLayout(World(1, 2), tp=2), "ref", 1)[0] == per_rank
    assert state_bytes(shape, RoleLayout(World(1, 2), tp=1, fsdp_size=1), "ref", 1)[0] == shape.params
