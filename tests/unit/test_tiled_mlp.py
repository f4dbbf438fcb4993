"""Tiled MLP: the same values and every gradient as the model's own MLP, the same parameter names,
one saved tensor per MLP; the config keys are validated with the offending value and the legal ones.

Reference: the untiled tiny Qwen2 decoder (a deep copy of the same weights). The tiles only reorder
floating-point sums (of parameter gradients, and the matmuls' blocking): values and gradients agree within
tests/tolerances.py's `model_rtol` of this decoder over its N tokens, in its dtype (measured: <= 1/35 of it;
the MLP alone: <= 1/9).
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_config import make as _config
from tolerances import assert_grads_close, model_rtol, rel_error, roundoff_rtol
from torch import nn
from transformers import Qwen2Config, Qwen2Model

from rlsp.config.validate import validate_config
from rlsp.models.tiled_mlp import TiledMLP, apply_tiled_mlp

N = 13  # tokens: 4 and 5 tiles do not divide it; 20 tiles are more than the tokens


def _decoder(dtype: torch.dtype, checkpointing: bool = False) -> Qwen2Model:
    config = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=88, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = Qwen2Model(config).to(dtype)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _run(model: Qwen2Model, ids: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, dict]:
    out = model(input_ids=ids).last_hidden_state
    out.backward(grad_out)
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("num_shards,checkpointing", [(1, False), (2, False), (4, False), (5, True), (20, False)])
def test_tiled_decoder_matches_untiled_values_and_every_gradient(dtype, num_shards, checkpointing):
    plain = _decoder(dtype, checkpointing)
    tiled = copy.deepcopy(plain)
    apply_tiled_mlp(tiled, num_shards)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (1, N), generator=g)
    grad_out = torch.randn(1, N, 32, generator=g).to(dtype)
    ref_out, ref_grads = _run(plain, ids, grad_out)
    out, grads = _run(tiled, ids, grad_out)
    forward, backward = (model_rtol(plain.config, N, backward=b, dtype=dtype) for b in (False, True))
    assert rel_error(out, ref_out) <= forward, (rel_error(out, ref_out), forward)
    assert grads.keys() == ref_grads.keys() and len(grads) == len(list(plain.parameters()))
    for name in grads:  # every parameter, the MLP's and everything upstream of it
        assert float(ref_grads[name].norm()) > 0, name
    assert_grads_close(grads, ref_grads, backward)


@pytest.mark.parametrize("num_shards", [1, 3, 4, 8])
def test_tiled_mlp_input_gradient_and_batched_shape(num_shards):
    """On the MLP alone: [B, S, H] input (leading dims flattened into tiles), dL/dx and dL/dW in fp64."""
    mlp = _decoder(torch.float64).layers[0].mlp
    reference = copy.deepcopy(mlp)
    tiled = TiledMLP(mlp, num_shards)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 32, generator=g, dtype=torch.float64)
    grad_out = torch.randn(2, 5, 32, generator=g, dtype=torch.float64)
    x_ref, x_tiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    reference(x_ref).backward(grad_out)
    y = tiled(x_tiled)
    y.backward(grad_out)
    assert y.shape == (2, 5, 32)
    # the MLP's two matmuls (the longest over its 88-wide intermediate), their transposes backward, in fp64
    forward = roundoff_rtol(reduction=mlp.config.intermediate_size, stages=2, dtype=torch.float64)
    backward = roundoff_rtol(reduction=mlp.config.intermediate_size, stages=4, dtype=torch.float64)
    assert rel_error(y.detach(), reference(x).detach()) <= forward
    assert rel_error(x_tiled.grad, x_ref.grad) <= backward
    for (name, p), (ref_name, q) in zip(tiled.named_parameters(), reference.named_parameters(), strict=True):
        assert name == ref_name and rel_error(p.grad, q.grad) <= backward, name


def test_names_and_parameter_objects_are_preserved():
    model = _decoder(torch.float32)
    before = list(model.named_parameters())
    keys = list(model.state_dict())
    apply_tiled_mlp(model, 4)
    after = list(model.named_parameters())
    assert [n for n, _ in after] == [n for n, _ in before]
    assert all(p is q for (_, p), (_, q) in zip(after, before, strict=True))
    assert list(model.state_dict()) == keys
    assert "layers.0.mlp.gate_proj.weight" in keys
    assert all(isinstance(layer.mlp, TiledMLP) for layer in model.layers)


def test_only_the_mlp_input_is_saved():
    """Tiled: one saved tensor per MLP call (its [N, H] input); untiled: the [N, I] intermediates too."""
    mlp = _decoder(torch.float32).layers[0].mlp
    x = torch.randn(1, N, 32, requires_grad=True)

    def saved_bytes(module: nn.Module) -> list[int]:
        sizes: list[int] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            module(x)
        return sizes

    plain = saved_bytes(mlp)
    tiled = saved_bytes(TiledMLP(copy.deepcopy(mlp), 4))
    assert tiled == [N * 32]
    assert sum(s == N * 88 for s in plain) >= 3  # gate, activation / up, product of the untiled MLP


def test_refuses_bad_num_shards_other_mlps_and_a_second_application():
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match=rf"tiled_mlp.num_shards={bad!r} must be an integer >= 1"):
            apply_tiled_mlp(_decoder(torch.float32), bad)
    model = _decoder(torch.float32)
    model.layers[1].mlp = nn.Sequential(nn.Linear(32, 88), nn.ReLU(), nn.Linear(88, 32))
    with pytest.raises(ValueError, match=r"decoder layer 1: mlp Sequential has children \['0', '1', '2'\].*gate_proj"):
        apply_tiled_mlp(model, 2)
    model = _decoder(torch.float32)
    apply_tiled_mlp(model, 2)
    with pytest.raises(RuntimeError, match="already tiled"):
        apply_tiled_mlp(model, 2)


@pytest.mark.parametrize("prefix", ["actor_rollout_ref.model", "critic.model"])
def test_validation_names_key_value_and_legal_values(prefix):
    critic = {"algorithm.adv_estimator": "gae"}
    with pytest.raises(ValueError) as err:
        validate_config(_config(**critic, **{f"{prefix}.tiled_mlp.num_shards": 0}))
    assert f"{prefix}.tiled_mlp.num_shards=0 must be an integer >= 1" in str(err.value)
    assert "legal values: 1, 2, 3" in str(err.value)
    tp_key = "actor_rollout_ref.actor" if prefix.startswith("actor") else "critic"
    with pytest.raises(ValueError) as err:
        validate_config(_config(**critic, **{f"{prefix}.tiled_mlp.enabled": True,
                                             f"{tp_key}.tensor_model_parallel_size": 2}))
    msg = str(err.value)
    assert f"{prefix}.tiled_mlp.enabled=true does not combine with {tp_key}.tensor_model_parallel_size=2" in msg
    assert "tiled_mlp.enabled=false, or tensor_model_parallel_size=1" in msg
    validate_config(_config(**critic, **{f"{prefix}.tiled_mlp.enabled": True, f"{prefix}.tiled_mlp.num_shards": 3}))
