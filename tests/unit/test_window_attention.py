"""Sliding windows and soft-capping (Gemma 2 / Gemma 3) in rlsp's packed attention and logprob head.

- rlsp_ulysses (sp=1 context) on a windowed / soft-capped layer equals transformers' own Gemma 2 eager
  attention run per segment with transformers' own sliding-window mask, every element, values and
  gradients, fp64 inputs (transformers' softmax runs in fp32: fp32's bound); windows shorter and longer than the segments; the padded path (short segments, one call) and the chunked
  one (query chunks smaller than a segment).
- The soft-capped vocab-chunked head equals log_softmax(cap * tanh(logits / cap) / temperature), entropy
  and sum of p^2 included, and its written-out gradient equals autograd's.
- A tiny Gemma 2 and Gemma 3 (text) model through rlsp's packed forward equal transformers' eager forward of
  each row on its own (fp64 weights; Gemma's norms compute in fp32, so the bound is fp32's).
Bounds: tests/tolerances.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from tiny_gemma import FAMILIES, HEADS, WINDOW, gemma_config
from tolerances import assert_tensor_close, logprob_tol, rel_error, roundoff_rtol
from transformers import AutoModelForCausalLM
from transformers.masking_utils import sliding_window_causal_mask_function
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

import rlsp.models.attention as attention
import rlsp.models.window_attention as window_attention
from rlsp.data.packing import pack_sequences
from rlsp.models.attention import ulysses_attention
from rlsp.models.lm import TokenLogprobModel
from rlsp.models.loading import build_causal_lm_from_config
from rlsp.models.logprobs import compute_token_logprobs, compute_token_logprobs_sum_pi_squared
from rlsp.parallel.ulysses import build_sp_context

LENS = (7, 13, 3, 1, 10)
(HQ, HKV), D = HEADS, 8
VOCAB = 50


class _Layer(torch.nn.Module):
    layer_idx, num_key_value_groups = 0, HQ // HKV


def _eager_reference(q, k, v, window, softcap, scale):
    """transformers' Gemma 2 eager attention per segment, with transformers' own sliding-window mask."""
    out, start = [], 0
    for n in LENS:
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        if window is None:
            allowed = j <= i
        else:
            allowed = sliding_window_causal_mask_function(window)(0, 0, i, j)
        mask = torch.zeros(n, n, dtype=q.dtype).masked_fill(~allowed, float("-inf"))[None, None]
        seg = [x[start:start + n].transpose(0, 1)[None] for x in (q, k, v)]
        o, _ = eager_attention_forward(_Layer().eval(), *seg, mask, scaling=scale, softcap=softcap)
        out.append(o[0])
        start += n
    return torch.cat(out)


# window 50: longer than every segment; (None, None) is plain causal attention (test_attention_paths.py)
@pytest.mark.parametrize("window,softcap", [(2, None), (4, None), (50, None), (2, 1.5), (4, 1.5), (50, 1.5),
                                            (None, 1.5)])
@pytest.mark.parametrize("chunk", [5, None])  # 5: query chunks shorter than a segment; None: the padded path
def test_windowed_softcapped_attention_equals_transformers_eager(monkeypatch, window, softcap, chunk) -> None:
    if chunk is not None:
        monkeypatch.setattr(window_attention, "_CHUNK", chunk)
    padded_calls = []
    monkeypatch.setattr(attention, "padded_band_attention",
                        lambda *a, **k: padded_calls.append(1) or window_attention.padded_band_attention(*a, **k))
    width = max(LENS)
    ids = torch.ones(len(LENS), width, dtype=torch.long)
    mask = (torch.arange(width)[None, :] < torch.tensor(LENS)[:, None]).long()
    ctx = build_sp_context(None, pack_sequences(ids, mask), HQ, HKV)
    gen = torch.Generator().manual_seed(0)
    T, scale = sum(LENS), 0.4
    q, k, v = (torch.randn(T, h, D, generator=gen, dtype=torch.float64, requires_grad=True) for h in (HQ, HKV, HKV))
    out, _ = ulysses_attention(_Layer(), *(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), None, scaling=scale,
                               sp_context=ctx, sliding_window=window, softcap=softcap)
    assert bool(padded_calls) == (chunk is None)
    ref = _eager_reference(q, k, v, window, softcap, scale)
    # transformers' eager attention rounds its softmax to fp32 whatever the inputs' dtype: fp32's bound
    rtol = roundoff_rtol(reduction=max(LENS) * D, stages=3, dtype=torch.float32)
    assert_tensor_close(out[0], ref, rtol)
    w = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out[0] * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        assert_tensor_close(g, r, 2 * rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softcapped_logprob_head_and_gradient(dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    T, H, V, cap, temp = 23, 16, 40, 2.0, 0.7
    hidden = torch.randn(T, H, generator=gen, dtype=dtype, requires_grad=True)
    weight = torch.randn(V, H, generator=gen, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, V, (T,), generator=gen)
    lp, ent = compute_token_logprobs(hidden, weight, labels, temperature=temp, chunk_size=5, with_entropy=True,
                                     softcap=cap)
    logits = (hidden @ weight.t()).to(torch.promote_types(dtype, torch.float32))
    logp = torch.log_softmax(cap * torch.tanh(logits / cap) / temp, -1)
    ref_lp, ref_ent = logp.gather(-1, labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    rtol = roundoff_rtol(reduction=max(H, V, T), stages=3, dtype=dtype)
    assert_tensor_close(lp, ref_lp, rtol, value_scale=math.log(V))
    assert_tensor_close(ent, ref_ent, rtol, value_scale=math.log(V))
    _, sum_sq = compute_token_logprobs_sum_pi_squared(hidden.detach(), weight.detach(), labels, temperature=temp,
                                                      chunk_size=5, softcap=cap)
    assert_tensor_close(sum_sq, logp.exp().square().sum(-1), rtol, value_scale=1.0)
    w_lp, w_ent = (torch.randn(T, generator=gen, dtype=lp.dtype) for _ in range(2))
    grads = torch.autograd.grad((w_lp * lp).sum() + (w_ent * ent).sum(), (hidden, weight))
    ref_grads = torch.autograd.grad((w_lp * ref_lp).sum() + (w_ent * ref_ent).sum(), (hidden, weight),
                                    retain_graph=True)
    for g, r in zip(grads, ref_grads):
        assert rel_error(g, r) <= 2 * rtol, (rel_error(g, r), 2 * rtol)
    # without the cap's derivative the gradient would be off by O(1): the test can see it
    plain = torch.autograd.grad(compute_token_logprobs(hidden, weight, labels, temperature=temp)[0].sum(), hidden)[0]
    assert rel_error(plain, torch.autograd.grad(ref_lp.sum(), hidden)[0]) > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_gemma_logprobs_equal_transformers_forward(family) -> None:
    config = gemma_config(family, vocab=VOCAB)
    torch.manual_seed(0)
    model = build_causal_lm_from_config(config, dtype=torch.float64)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float64)
    ref.load_state_dict(model.state_dict())
    width = max(LENS)
    ids = torch.randint(1, VOCAB, (len(LENS), width), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(width)[None, :] < torch.tensor(LENS)[:, None]).long()
    packed = pack_sequences(ids, mask)
    out = TokenLogprobModel(model)(packed.input_ids, packed.position_ids, packed.labels,
                                   build_sp_context(None, packed, HQ, HKV))["logprobs"]
    # each row alone: transformers' eager padded batch turns padding rows into NaN under Gemma's masks
    rows = []
    with torch.no_grad():
        for b, n in enumerate(LENS):
            logp = ref(input_ids=ids[b:b + 1, :n]).logits[0].log_softmax(-1)
            rows.append(logp[:n - 1].gather(-1, ids[b, 1:n, None])[:, 0])
    got = out[packed.label_mask.bool()].detach()
    # Gemma's RMSNorm computes in fp32 whatever the weights' dtype: fp32's bound
    tol = logprob_tol(config, sum(LENS), dtype=torch.float32)
    err = float((got - torch.cat(rows)).abs().max())
    assert got.numel() == sum(n - 1 for n in LENS) and err <= tol, (err, tol)
    # the window matters on these rows: one key more moves the logprobs far beyond the bound
    wide = copy.deepcopy(config)
    wide.sliding_window = WINDOW + 1
    widened = build_causal_lm_from_config(wide, dtype=torch.float64)
    widened.load_state_dict(model.state_dict())
    with torch.no_grad():
        off = TokenLogprobModel(widened)(packed.input_ids, packed.position_ids, packed.labels,
                                         build_sp_context(None, packed, HQ, HKV))["logprobs"]
    assert float((off[packed.label_mask.bool()] - torch.cat(rows)).abs().max()) > 1e3 * tol
