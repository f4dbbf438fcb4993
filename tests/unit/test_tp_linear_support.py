"""Which Gated DeltaNet (linear attention) models rlsp's tensor parallelism takes, and the layer's group split.

- Legal sizes: tp must divide the q and kv heads, the dense MLPs' intermediate_size (none in a model whose every
  MLP is a MoE block) and linear_num_key_heads (the layer splits by key-head groups); a size it does not divide is
  refused naming linear_num_key_heads, its value and the legal list. The planner's ModelShape.legal_tp agrees with
  rlsp.parallel.tp_checks.legal_tp_sizes on every case; a Qwen3.5 wrapper checkpoint is its text model to both.
- The planner counts what a tp rank holds of a Gated DeltaNet layer: the sharded projections halved, Qwen3.5's
  in_proj_qkv, the conv, decay and norm weights whole (rlsp.plan.memory.tp_replicated).
- One process: the layer run on each tp rank's group range (`groups`), with the full weights or with a tp rank's
  shards of them, sums to the whole layer's output over packed rows of unequal lengths, every element within the
  reordering bound of tests/tolerances.py (the projections and out_proj sum in another order).
- GroupShardedGatedDeltaNet refuses a module that is not rlsp's Gated DeltaNet, or one with projection biases.
Exactness of a whole training step at tp 2: tests/distributed/test_tp_linear_exact.py.
"""

from __future__ import annotations

import pytest
import torch
from tiny_linear import FAMILIES, HEADS, linear_config
from tolerances import assert_tensor_close, roundoff_rtol
from transformers import Qwen3_5Config

from rlsp.config.layout import RoleLayout, World
from rlsp.config.model_shape import shape_from_config, shape_of_config
from rlsp.data.packing import pack_sequences
from rlsp.models.family_checks import check_tp_windowed
from rlsp.models.loading import build_causal_lm_from_config
from rlsp.parallel.tp_checks import check_tp_support, legal_tp_sizes
from rlsp.parallel.tp_linear_attention import SHARDED_WEIGHTS, GroupShardedGatedDeltaNet, check_groups
from rlsp.parallel.ulysses import build_sp_context
from rlsp.plan.memory import state_bytes, tp_replicated

LENS = (70, 13, 5)  # packed rows of unequal lengths (the first spans two 64-token chunks of the delta rule)
# (config overrides, legal tp of a model with a dense MLP, legal tp of one whose every MLP is a MoE block)
SIZES = [
    ({}, [1, 2], [1, 2]),  # 4 q / 2 kv heads, intermediate 48, 2 key heads
    (dict(linear_num_key_heads=3, linear_num_value_heads=6), [1], [1]),  # 3 key heads: odd
    (dict(num_attention_heads=8, num_key_value_heads=4, linear_num_key_heads=4, linear_num_value_heads=8),
     [1, 2, 4], [1, 2, 4]),
    (dict(num_attention_heads=8, num_key_value_heads=4, linear_num_key_heads=4, linear_num_value_heads=8,
          intermediate_size=18), [1, 2], [1, 2, 4]),  # the dense width 18 limits tp to 2
    (dict(num_attention_heads=8, num_key_value_heads=4, linear_num_key_heads=2, linear_num_value_heads=8),
     [1, 2], [1, 2]),  # 2 key heads (4 value heads each) limit tp to 2
]


def _dense(family: str, config) -> bool:
    return family == "qwen3_5_text" or bool(getattr(config, "mlp_only_layers", None))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("extra,dense_legal,moe_legal", SIZES)
def test_legal_tp_sizes_split_the_key_heads_and_the_planner_agrees(family, extra, dense_legal, moe_legal):
    config = linear_config(family, **extra)
    legal = dense_legal if _dense(family, config) else moe_legal
    assert legal_tp_sizes(config) == legal
    shape = shape_from_config(config.to_dict(), family)
    assert shape.tp_refusal() is None and shape.legal_tp() == legal
    check_tp_windowed(config, 2)
    for tp in legal:
        check_tp_support(config, tp)


def test_a_dense_layer_of_a_moe_family_counts_its_width():
    """qwen3_next with layer 1 a dense MLP (mlp_only_layers): its intermediate_size 18 limits tp to 2."""
    config = linear_config("qwen3_next", num_attention_heads=8, num_key_value_heads=4, linear_num_key_heads=4,
                           linear_num_value_heads=8, intermediate_size=18, mlp_only_layers=[1])
    assert legal_tp_sizes(config) == [1, 2] == shape_from_config(config.to_dict()).legal_tp()


@pytest.mark.parametrize("family", FAMILIES)
def test_key_heads_tp_does_not_divide_are_refused_by_name(family):
    config = linear_config(family, linear_num_key_heads=3, linear_num_value_heads=6)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=2 does not divide 4 q heads / 2 kv heads.* / "
                                         r"linear_num_key_heads 3; legal tensor_model_parallel_size for this model: 1$"):
        check_tp_support(config, 2)
    with pytest.raises(ValueError, match=r"linear_num_key_heads=3 is not a multiple of tensor_model_parallel_size=2 "
                                         r"\(.*key-head groups\); legal tensor_model_parallel_size for them: 1, 3$"):
        check_groups(3, 2)


def test_a_qwen3_5_wrapper_takes_tp_as_its_text_model():
    """A Qwen3.5 wrapper checkpoint trained text-only is its text model to tp: the start-up checks and the planner
    give the text model's legal sizes (a run whose rows load the tower is refused: test_qwen3_5_vision_run.py)."""
    text = linear_config("qwen3_5_text")
    config = Qwen3_5Config(text_config=text.to_dict())
    check_tp_windowed(config, 2)
    shape = shape_of_config(config.to_dict())
    assert shape.tp_refusal() is None and shape.legal_tp() == legal_tp_sizes(text) == shape_of_config(text.to_dict()).legal_tp()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_planner_counts_what_a_tp_rank_holds_of_the_linear_layers(family):
    """At tp 2 the planner's parameters a tp rank holds whole (`tp_replicated`) of a linear layer exceed those of
    the full-attention layer (same MLP) by the Gated DeltaNet's replicated weights: Qwen3.5's in_proj_qkv, conv1d,
    A_log, dt_bias, the norm (the sharded projections are split); none at tp 1. qwen3_5_text, dense: the planner's
    whole state per rank (one FSDP rank) equals what the layer plan leaves a tp rank of the transformers model."""
    config = linear_config(family)
    model = build_causal_lm_from_config(config).model
    shape = shape_from_config(config.to_dict(), family)
    tp2 = RoleLayout(World(1, 2), tp=2)
    whole = {f"linear_attn.{n}" for n, _ in model.layers[0].linear_attn.named_parameters()} - {
        f"linear_attn.{n}" for n in SHARDED_WEIGHTS}
    held = sum(p.numel() for n, p in model.layers[0].named_parameters() if n in whole)
    linear_kind, full_kind = shape.kinds[0], shape.kinds[1]  # LAYER_TYPES: linear, full, linear
    assert tp_replicated(shape, linear_kind, tp2) - tp_replicated(shape, full_kind, tp2) == held
    assert tp_replicated(shape, linear_kind, RoleLayout(World(1, 2), tp=1, fsdp_size=1)) == 0
    if family == "qwen3_5_text":
        per_rank = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("layers."))
        per_rank += config.vocab_size * config.hidden_size  # the untied lm_head
        per_rank += sum(p.numel() / (1 if n in whole else 2) for layer in model.layers
                        for n, p in layer.named_parameters())
        assert state_bytes(shape, tp2, "ref", 1)[0] == per_rank


def _packed_context():
    width = max(LENS)
    ids = torch.ones(len(LENS), width, dtype=torch.long)
    mask = (torch.arange(width)[None, :] < torch.tensor(LENS)[:, None]).long()
    return build_sp_context(None, pack_sequences(ids, mask), *HEADS)


def _shard(param: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    return param.chunk(tp, dim=dim)[rank]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sharded", [False, True], ids=["full_weights", "tp_shards"])
def test_the_group_ranges_sum_to_the_whole_layer(family, sharded):
    # conditioned as tests/tiny_linear.py's write_tiny_linear: initializer_range 0.08, decay rates A in [0.3, 3]
    config = linear_config(family, linear_num_key_heads=4, linear_num_value_heads=8, initializer_range=0.08)
    torch.manual_seed(0)
    layer = build_causal_lm_from_config(config).model.layers[0].linear_attn
    with torch.no_grad():
        layer.A_log.copy_(torch.linspace(0.3, 3.0, layer.A_log.numel()).log())
    ctx = _packed_context()
    hidden_1SH = torch.randn(1, sum(LENS), config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref_1SH = layer(hidden_1SH, sp_context=ctx)
        got_1SH = torch.zeros_like(ref_1SH)
        params = dict(layer.named_parameters())
        tp = 2
        for rank in range(tp):
            layer.groups = (rank * 4 // tp, (rank + 1) * 4 // tp)
            local = {n: _shard(p, SHARDED_WEIGHTS[n], rank, tp) for n, p in params.items()
                     if sharded and n in SHARDED_WEIGHTS}
            got_1SH += torch.func.functional_call(layer, local, (hidden_1SH,), {"sp_context": ctx})
        layer.groups = (0, 4)
    # the projections (hidden_size terms) and out_proj (value_dim terms) sum in another order; the delta rule's
    # chunked reductions (up to 64 tokens) and the gated norm (value head dim) carry their inputs' differences
    reduction = max(config.hidden_size, layer.value_dim, 64)
    assert_tensor_close(got_1SH, ref_1SH, roundoff_rtol(reduction=reduction, stages=4))


def test_the_style_refuses_other_modules_and_biases():
    with pytest.raises(ValueError, match=r"Linear is not rlsp's UlyssesGatedDeltaNet"):
        GroupShardedGatedDeltaNet(None)._apply(torch.nn.Linear(4, 4), None)
    config = linear_config("qwen3_5_text")
    layer = build_causal_lm_from_config(config).model.layers[0].linear_attn
    layer.out_proj = torch.nn.Linear(layer.value_dim, config.hidden_size, bias=True)
    with pytest.raises(ValueError, match=r"has biases on \['out_proj'\]"):
        GroupShardedGatedDeltaNet(None)._apply(layer, None)
