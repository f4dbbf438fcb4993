"""The start-up self-check compares the sharded forward with an unsharded one: it passes on the real
layouts (Ulysses, ring, tensor parallel with and without sequence-parallel activations, and their
combinations) and stops the run on a deliberately broken one. The bound on a logprob's difference is
tests/tolerances.py's for two forwards of the model (`_logprob_tol`); a broken layout is off by > 1e-2."""

from __future__ import annotations

import dataclasses

import pytest
from _launch import layout_dims, run_distributed
from test_fsdp_engine import P, _rollout_batch, policy_engine, tolerances
from tolerances import scalar_tol

import rlsp.engine.micro as micro_module
from rlsp.engine.fsdp_engine import assert_sp_matches
from rlsp.models.tiny import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.distributed


def _install_broken_context() -> None:
    """Make rank 0 send rank 1 the wrong KV head: shapes still fit, numbers do not."""
    original = micro_module.build_sp_context

    def broken(group, packed, num_q_heads, num_kv_heads, **groups):
        ctx = original(group, packed, num_q_heads, num_kv_heads, **groups)
        if group is not None and ctx.ulysses_rank == 0:
            kv = ctx.layout.kv_ranges
            ctx.layout = dataclasses.replace(ctx.layout, kv_ranges=(kv[0],) * len(kv))
        return ctx

    micro_module.build_sp_context = broken


def _self_check(rank: int, world: int, model_path: str, batch, broken: bool, degrees: dict | None = None) -> float:
    if broken:  # only in this forked worker process
        _install_broken_context()
    dims = layout_dims(**(degrees or {"ulysses": world}))
    engine = policy_engine(model_path, dims, trainable=False)
    return engine.sp_self_check(batch, P, "logprobs", temperature=1.0)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    return build_tiny_model(spec, str(tmp_path_factory.mktemp("tiny")))


def _logprob_tol(model_path: str) -> float:
    """Two forwards of the model over a batch (the sharded and the unsharded one), at a logprob's scale
    (measured: <= 1/90 of it on every layout here)."""
    rtol, _, scale = tolerances(model_path)
    return scalar_tol(scale, rtol)


def test_self_check_passes_on_the_real_layout(model_path):
    from transformers import AutoConfig

    batch = _rollout_batch(AutoConfig.from_pretrained(model_path).vocab_size)
    diffs = run_distributed(_self_check, 2, model_path, batch, False)
    assert max(diffs) <= _logprob_tol(model_path), (diffs, _logprob_tol(model_path))
    assert_sp_matches(max(diffs), _logprob_tol(model_path), "dp=1 ulysses=2 ring=1 tp=1")


def test_self_check_stops_a_broken_layout(model_path):
    from transformers import AutoConfig

    batch = _rollout_batch(AutoConfig.from_pretrained(model_path).vocab_size)
    diffs = run_distributed(_self_check, 2, model_path, batch, True)
    assert max(diffs) > 1e-2
    with pytest.raises(RuntimeError, match=r"self-check failed: max \|logprob\(dp=1 ulysses=2 ring=1 tp=1\) - "
                                           r"logprob\(unsharded\)\|"):
        assert_sp_matches(max(diffs), _logprob_tol(model_path), "dp=1 ulysses=2 ring=1 tp=1")


@pytest.mark.parametrize("world,degrees", [
    (2, {"ring": 2}), (2, {"tp": 2}), (2, {"tp": 2, "sequence_parallel": False}), (4, {"ulysses": 2, "tp": 2}),
    (4, {"ring": 2, "tp": 2})])
def test_self_check_covers_ring_and_tensor_parallel(model_path, world, degrees):
    from transformers import AutoConfig

    batch = _rollout_batch(AutoConfig.from_pretrained(model_path).vocab_size)
    diffs = run_distributed(_self_check, world, model_path, batch, False, degrees)
    assert max(diffs) <= _logprob_tol(model_path), (degrees, diffs, _logprob_tol(model_path))
