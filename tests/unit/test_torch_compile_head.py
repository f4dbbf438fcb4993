"""use_torch_compile (verl's key): the entropy head's per-block reduction through torch.compile (what verl compiles:
its entropy from logits) gives every token's logprob and entropy within fp32 rounding of the eager head, and the
same gradients; off, nothing is compiled. Bounds: tests/tolerances.py (reductions over the vocabulary)."""

from __future__ import annotations

import time

import torch
from tolerances import assert_tensor_close, rel_error, roundoff_rtol

from rlsp.models.logprobs import compiled_block_entropy, compute_token_logprobs


def test_compiled_entropy_head_matches_eager_every_element():
    torch.manual_seed(0)
    T, H, V = 300, 32, 1000  # 3 row blocks of 128 (the last partial), 2 chunks
    hidden = (torch.randn(T, H) * 0.5).requires_grad_()
    weight = torch.randn(V, H).requires_grad_()
    labels = torch.randint(0, V, (T,))
    start = time.perf_counter()
    compiled_block_entropy()  # compile + probe once (cached on disk by inductor across runs)
    print(f"compile: {time.perf_counter() - start:.1f} s")
    out = {}
    for compiled in (False, True):
        lp, ent = compute_token_logprobs(hidden, weight, labels, chunk_size=256, with_entropy=True, compiled=compiled,
                                         temperature=0.7)
        (lp.sum() + 0.1 * ent.sum()).backward()
        out[compiled] = (lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone())
        hidden.grad, weight.grad = None, None
    rtol = roundoff_rtol(reduction=V, stages=2)  # logsumexp and sum_v p_v logit_v over the vocabulary
    for got, ref in zip(out[True][:2], out[False][:2]):
        assert_tensor_close(got, ref, rtol)
    print("max |diff| logprob, entropy:", [float((a - b).abs().max()) for a, b in zip(out[True][:2], out[False][:2])],
          "bound rtol", rtol)
    for got, ref in zip(out[True][2:], out[False][2:]):  # backward is eager; it reads the forward's lse and entropy
        assert rel_error(got, ref) <= roundoff_rtol(reduction=V, stages=4)


def test_off_compiles_nothing(monkeypatch):
    def refuse():
        raise AssertionError("compiled without use_torch_compile")

    monkeypatch.setattr("rlsp.models.logprobs.compiled_block_entropy", refuse)
    hidden, weight = torch.randn(4, 8), torch.randn(16, 8)
    compute_token_logprobs(hidden, weight, torch.zeros(4, dtype=torch.long), with_entropy=True, compiled=False)
    compute_token_logprobs(hidden, weight, torch.zeros(4, dtype=torch.long), compiled=True)  # no entropy: nothing to compile


def test_setting_per_role_and_bad_values(caplog):
    from rlsp.workers.roles.common import torch_compile_enabled  # noqa: PLC0415

    cpu = torch.device("cpu")
    assert torch_compile_enabled("auto", cpu, "actor") is False  # auto: cuda only
    assert torch_compile_enabled(False, cpu, "actor") is False
    assert torch_compile_enabled(True, cpu, "ref") is False  # the reference computes no entropy
    assert torch_compile_enabled(True, cpu, "actor") is True
    try:
        torch_compile_enabled("yes", cpu, "actor")
    except ValueError as exc:
        assert "use_torch_compile='yes'" in str(exc) and "[true, false, auto]" in str(exc)
    else:
        raise AssertionError("a bad value was accepted")
