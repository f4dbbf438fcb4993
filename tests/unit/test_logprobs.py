"""Vocab-chunked token logprobs and entropy equal the naive full-logits computation (fp64 reference).

fp32 bounds from tests/tolerances.py: the logits' matmul (H terms), the log-sum-exp and the entropy's sum
(V terms) are the forward's reductions, doubled for the gradients (which also sum over the T tokens), at the
scale of the largest logit (what the log-sum-exp's terms and the logits' roundoff are relative to). These
logits are O(10) (unit-variance inputs), not a model's O(1): the gradients of log p and p log p, terms of
O(1), carry the logits' absolute roundoff u max|z|, so their relative bound has max|z| as a conditioning
factor (measured: 1/25 to 1/45 of the bound; a chunk lost or counted twice is off by O(1))."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_tensor_close, rel_error, roundoff_rtol

from rlsp.models.logprobs import compute_token_logprobs


def _naive(hidden_TH: torch.Tensor, weight_VH: torch.Tensor, labels_T: torch.Tensor, temperature: float):
    logits_TV = (hidden_TH.double() @ weight_VH.double().t()) / temperature
    logp_TV = torch.log_softmax(logits_TV, dim=-1)
    entropy_T = -(logp_TV.exp() * logp_TV).sum(-1)
    return logp_TV.gather(-1, labels_T[:, None])[:, 0], entropy_T


T, H, V = 37, 16, 29  # tokens, hidden size, vocabulary


def _inputs(T: int = T, H: int = H, V: int = V, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=gen, dtype=dtype, requires_grad=True)
    weight = torch.randn(V, H, generator=gen, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, V, (T,), generator=gen)
    return hidden, weight, labels


@pytest.mark.parametrize("chunk_size", [1, 5, 37, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_and_gradients_match_naive(chunk_size: int, temperature: float) -> None:
    hidden, weight, labels = _inputs()
    lp, ent = compute_token_logprobs(
        hidden, weight, labels, temperature=temperature, chunk_size=chunk_size, with_entropy=True
    )
    assert lp.dtype == torch.float32 and ent is not None and ent.dtype == torch.float32
    ref_lp, ref_ent = _naive(hidden, weight, labels, temperature)
    scale = float((hidden.double() @ weight.double().t()).abs().max()) / temperature
    forward = roundoff_rtol(reduction=max(H, V), stages=3)  # matmul, log-sum-exp, entropy's sum
    assert_tensor_close(lp, ref_lp, forward, value_scale=scale)
    assert_tensor_close(ent, ref_ent, forward, value_scale=scale)

    gen = torch.Generator().manual_seed(3)
    w_lp, w_ent = torch.randn(lp.shape[0], generator=gen), torch.randn(lp.shape[0], generator=gen)
    grads = torch.autograd.grad((w_lp * lp).sum() + (w_ent * ent).sum(), (hidden, weight))
    ref_grads = torch.autograd.grad((w_lp.double() * ref_lp).sum() + (w_ent.double() * ref_ent).sum(), (hidden, weight))
    backward = roundoff_rtol(reduction=max(T, H, V), stages=6) * max(scale, 1.0)  # stages and their transposes
    for g, ref in zip(grads, ref_grads):
        assert rel_error(g, ref) <= backward, (rel_error(g, ref), backward)


@pytest.mark.parametrize("used", ["logprobs", "entropy"])
def test_an_output_the_loss_does_not_use_gets_no_gradient_work(used: str) -> None:
    """with_entropy=True but only one output in the loss (the entropy as a metric, as in an update with
    entropy_coeff=0): the other's gradient arrives as None and the result equals the naive gradient."""
    hidden, weight, labels = _inputs(dtype=torch.float64)
    lp, ent = compute_token_logprobs(hidden, weight, labels, chunk_size=8, with_entropy=True)
    ref_lp, ref_ent = _naive(hidden, weight, labels, 1.0)
    out, ref = (lp, ref_lp) if used == "logprobs" else (ent, ref_ent)
    w = torch.randn(out.shape[0], generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grads = torch.autograd.grad((w * out).sum(), (hidden, weight))
    ref_grads = torch.autograd.grad((w * ref).sum(), (hidden, weight))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=0)


def test_fp64_exact_and_without_entropy() -> None:
    hidden, weight, labels = _inputs(dtype=torch.float64)
    lp, ent = compute_token_logprobs(hidden, weight, labels, chunk_size=8)
    assert ent is None
    ref_lp, _ = _naive(hidden, weight, labels, 1.0)
    assert lp.dtype == torch.float64  # fp64 inputs keep fp64 (fp32 is the floor, not the ceiling)
    torch.testing.assert_close(lp, ref_lp, atol=1e-12, rtol=0)


def test_bf16_inputs_give_fp32_outputs() -> None:
    hidden, weight, labels = _inputs(dtype=torch.bfloat16)
    lp, _ = compute_token_logprobs(hidden.detach(), weight.detach(), labels, chunk_size=10)
    # reference: the same bf16 logits upcast to fp64 (the matmul stays in the model dtype)
    logits = (hidden.detach() @ weight.detach().t()).double()
    ref = torch.log_softmax(logits, -1).gather(-1, labels[:, None])[:, 0]
    assert lp.dtype == torch.float32
    # the same bf16 logits on both sides: only the fp32 log-softmax (V terms, and the subtraction) differs
    assert_tensor_close(lp, ref, roundoff_rtol(reduction=V, stages=2), value_scale=float(logits.abs().max()))


def test_chunks_are_recomputed_not_stored() -> None:
    """Saved tensors hold no [chunk, V] logits: only inputs (hidden slices, weight, labels) are kept."""
    hidden, weight, labels = _inputs(T=64, H=8, V=4096)
    saved: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = compute_token_logprobs(hidden, weight, labels, chunk_size=16, with_entropy=True)
    assert not any(len(s) == 2 and s[-1] == 4096 and s[0] == 16 for s in saved), saved
    (lp.sum() + ent.sum()).backward()
    assert hidden.grad is not None and weight.grad is not None


def test_rejects_bad_arguments() -> None:
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="temperature"):
        compute_token_logprobs(hidden, weight, labels, temperature=0.0)
    with pytest.raises(ValueError, match="labels"):
        compute_token_logprobs(hidden, weight, labels[:-1])
    with pytest.raises(ValueError, match="chunk_size"):
        compute_token_logprobs(hidden, weight, labels, chunk_size=0)
