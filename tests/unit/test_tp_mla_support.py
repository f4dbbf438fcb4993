"""Which multi-latent attention models rlsp's tensor parallelism takes (rlsp.parallel.tp_checks, rlsp.parallel.tp_latent).

deepseek_v3 (with and without q_lora_rank) and deepseek_v2 pass the start-up checks at every tp that divides their
heads and, when a dense layer exists (first_k_dense_replace), its intermediate_size; the MoE blocks run replicated
over tp, so their expert width need not divide. Any other tp is refused naming the key, the value and the legal
sizes; other multi-latent families stay refused by name. The planner's shape (rlsp.config.model_shape, no torch)
gives the same legal sizes, and counts the latent projections whole on every tp rank. Exactness:
tests/distributed/test_tp_mla_exact.py.
"""

from __future__ import annotations

import pytest
import torch
from tiny_deepseek import VARIANTS, deepseek_config
from transformers import AutoModelForCausalLM

from rlsp.config.layout import RoleLayout, World
from rlsp.config.model_shape import shape_from_config
from rlsp.models.family_checks import check_tp_windowed
from rlsp.parallel.tp_checks import check_tp_support, legal_tp_sizes, local_head_counts
from rlsp.parallel.tp_experts import split_expert_block
from rlsp.parallel.tp_families import sparse_moe_block
from rlsp.parallel.tp_latent import LATENT, latent_attention
from rlsp.plan.memory import state_bytes

KEY = "tensor_model_parallel_size"


@pytest.mark.parametrize("variant", VARIANTS)
def test_deepseek_takes_every_tp_dividing_heads_and_dense_width(variant):
    config = deepseek_config(variant)  # 6 heads, a dense first layer of width 48
    assert legal_tp_sizes(config) == [1, 2, 3, 6]
    for tp in (1, 2, 3, 6):
        check_tp_windowed(config, tp)
        check_tp_support(config, tp)
    assert local_head_counts(config, 2) == (3, 3)
    assert shape_from_config(config.to_dict()).legal_tp() == [1, 2, 3, 6]


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_tp_not_dividing_the_heads_is_refused_with_key_value_and_legal_sizes(variant):
    with pytest.raises(ValueError, match=rf"^{KEY}=4 does not divide 6 q heads / 6 kv heads / intermediate_size 48; "
                                         rf"legal {KEY} for this model: 1, 2, 3, 6$"):
        check_tp_support(deepseek_config(variant), 4)


@pytest.mark.parametrize("dense,legal", [(1, [1]), (0, [1, 2, 3, 6])])
def test_the_dense_width_counts_only_where_a_dense_layer_exists(dense, legal):
    """intermediate_size 35 (no divisor in common with the 6 heads but 1) is the dense first layer's width; without
    dense layers (first_k_dense_replace=0) no MLP of that width is built and only the heads decide."""
    config = deepseek_config("v3", intermediate_size=35, first_k_dense_replace=dense)
    assert legal_tp_sizes(config) == legal
    assert shape_from_config(config.to_dict()).legal_tp() == legal
    if dense:
        with pytest.raises(ValueError, match=rf"{KEY}=2 does not divide .* intermediate_size 35; legal .*: 1$"):
            check_tp_support(config, 2)
    else:
        check_tp_support(config, 6)


def test_other_multi_latent_families_stay_refused_by_name():
    config = deepseek_config("v3")
    config.model_type = "minicpm3"  # kv_lora_rank without a verified tp plan
    check_tp_support(config, 1)
    with pytest.raises(ValueError, match=rf"^{KEY}=2: minicpm3 has multi-latent attention \(kv_lora_rank=10\), which "
                                         r"rlsp's tensor parallelism splits for \['deepseek_v2', 'deepseek_v3'\] "
                                         r"only; legal: 1$"):
        check_tp_support(config, 2)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_layer_plan_finds_latent_attention_and_the_sparse_blocks(variant):
    config = deepseek_config(variant)
    torch.manual_seed(0)
    layers = AutoModelForCausalLM.from_config(config).model.layers
    assert [latent_attention(layer.self_attn, config.model_type) for layer in layers] == [True] * 3
    assert not latent_attention(layers[0].self_attn, "llama")
    assert [sparse_moe_block(layer.mlp, config.model_type) for layer in layers] == [False, True, True]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_planner_counts_latent_projections_and_moe_blocks_whole_on_every_tp_rank(variant):
    """The planner's parameters per rank at tp 2 (one FSDP rank) equal what the layer plan leaves a tp rank of the
    transformers model: the latent projections and norms and the sparse blocks' router whole (their routed experts
    too where rlsp.parallel.tp_experts does not split them), the rest of a layer (the head projections, the split
    routed experts, the shared experts, the dense MLP; the layer norms by the planner's convention) halved, the
    embedding, lm_head and final norm whole."""
    config = deepseek_config(variant)
    model = AutoModelForCausalLM.from_config(config).model
    per_rank = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("layers."))
    per_rank += config.vocab_size * config.hidden_size  # the untied lm_head
    for layer in model.layers:
        moe = sparse_moe_block(layer.mlp, config.model_type)
        split = moe and split_expert_block(layer.mlp, config.model_type, 2)  # routed experts split over tp
        for name, p in layer.named_parameters():
            whole = name.split(".")[1] in LATENT or (moe and name.startswith("mlp.") and ".shared_experts." not in name
                                                     and not (split and ".experts." in name))
            per_rank += p.numel() / (1 if whole else 2)
    shape = shape_from_config(config.to_dict(), config.model_type)
    assert shape.tp_refusal() is None
    assert state_bytes(shape, RoleLayout(World(1, 2), tp=2), "ref", 1)[0] == per_rank
    assert state_bytes(shape, RoleLayout(World(1, 2), tp=1, fsdp_size=1), "ref", 1)[0] == shape.params
