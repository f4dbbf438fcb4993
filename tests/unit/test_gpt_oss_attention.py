"""gpt-oss (attention sinks, sliding + full layers, MoE) in rlsp's packed attention and logprob model.

- rlsp_ulysses (sp=1 context) with a layer's sinks (the `s_aux` kwarg) equals transformers' own gpt-oss eager
  attention run per segment with transformers' own sliding-window mask, every element: the output and the
  gradients of q, k, v and the sinks, fp64; windows shorter and longer than the segments and full layers; the
  padded path (short segments, one call) and the chunked one (query chunks smaller than a segment).
- A tiny gpt-oss (tests/tiny_gpt_oss.py) through rlsp's packed forward (TokenLogprobModel) equals transformers'
  eager forward of each row on its own (fp64 weights; gpt-oss's norms compute in fp32, so the bound is fp32's);
  moving the sinks or widening the window by one key moves the logprobs far beyond that bound.
Bounds: tests/tolerances.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_gpt_oss import HEADS, WINDOW, gpt_oss_config
from tolerances import assert_tensor_close, logprob_tol, roundoff_rtol
from transformers import AutoModelForCausalLM
from transformers.masking_utils import sliding_window_causal_mask_function
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

import rlsp.models.attention as attention
import rlsp.models.window_attention as window_attention
from rlsp.data.packing import pack_sequences
from rlsp.models.attention import ulysses_attention
from rlsp.models.lm import TokenLogprobModel
from rlsp.models.loading import build_causal_lm_from_config
from rlsp.parallel.ulysses import build_sp_context

LENS = (7, 13, 3, 1, 10)
(HQ, HKV), D = HEADS, 8
VOCAB = 50


class _Layer(torch.nn.Module):
    layer_idx, num_key_value_groups = 0, HQ // HKV

    def __init__(self, sinks: torch.Tensor) -> None:
        super().__init__()
        self.sinks = sinks


def _eager_reference(q, k, v, sinks, window, scale):
    """transformers' gpt-oss eager attention per segment, with transformers' own sliding-window mask."""
    out, start = [], 0
    for n in LENS:
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = (j <= i) if window is None else sliding_window_causal_mask_function(window)(0, 0, i, j)
        mask = torch.zeros(n, n, dtype=q.dtype).masked_fill(~allowed, float("-inf"))[None, None]
        seg = [x[start:start + n].transpose(0, 1)[None] for x in (q, k, v)]
        o, _ = eager_attention_forward(_Layer(sinks).eval(), *seg, mask, scaling=scale)
        out.append(o[0])
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("window", [None, 2, 4, 50])  # None: a full layer; 50: longer than every segment
@pytest.mark.parametrize("chunk", [5, None])  # 5: query chunks shorter than a segment; None: the padded path
def test_sink_attention_equals_transformers_eager(monkeypatch, window, chunk) -> None:
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
    sinks = (torch.randn(HQ, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    out, _ = ulysses_attention(_Layer(sinks), *(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), None,
                               scaling=scale, sp_context=ctx, sliding_window=window, s_aux=sinks)
    assert bool(padded_calls) == (chunk is None)
    ref = _eager_reference(q, k, v, sinks, window, scale)
    rtol = roundoff_rtol(reduction=max(LENS) * D, stages=3, dtype=torch.float64)
    assert_tensor_close(out[0].detach(), ref.detach(), rtol)
    w = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out[0] * w).sum(), (q, k, v, sinks))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v, sinks))
    for g, r in zip(grads, ref_grads):
        assert_tensor_close(g, r, 2 * rtol)
    # without the sinks the output is far off: the test can see them
    plain = _eager_reference(q, k, v, torch.full_like(sinks, -torch.inf), window, scale)
    assert float((plain - ref).detach().abs().max()) > 1e-2


def _rlsp_logprobs(model, packed) -> torch.Tensor:
    with torch.no_grad():
        out = TokenLogprobModel(model)(packed.input_ids, packed.position_ids, packed.labels,
                                       build_sp_context(None, packed, HQ, HKV))["logprobs"]
    return out[packed.label_mask.bool()]


def test_tiny_gpt_oss_logprobs_equal_transformers_forward() -> None:
    config = gpt_oss_config(vocab=VOCAB, experts_implementation="eager")  # grouped_mm has no fp64 kernel
    torch.manual_seed(0)
    model = build_causal_lm_from_config(config, dtype=torch.float64)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float64)
    ref.load_state_dict(model.state_dict())
    width = max(LENS)
    ids = torch.randint(1, VOCAB, (len(LENS), width), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(width)[None, :] < torch.tensor(LENS)[:, None]).long()
    packed = pack_sequences(ids, mask)
    got = _rlsp_logprobs(model, packed)
    rows = []
    with torch.no_grad():
        for b, n in enumerate(LENS):
            logp = ref(input_ids=ids[b:b + 1, :n]).logits[0].log_softmax(-1)
            rows.append(logp[:n - 1].gather(-1, ids[b, 1:n, None])[:, 0])
    expected = torch.cat(rows)
    # gpt-oss's RMSNorm computes in fp32 whatever the weights' dtype: fp32's bound
    tol = logprob_tol(config, sum(LENS), dtype=torch.float32)
    err = float((got - expected).abs().max())
    assert got.numel() == sum(n - 1 for n in LENS) and err <= tol, (err, tol)
    # the sinks and the window matter on these rows: moving either moves the logprobs far beyond the bound
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.add_(1.0)
    assert float((_rlsp_logprobs(model, packed) - expected).abs().max()) > 1e3 * tol
    wide = copy.deepcopy(config)
    wide.sliding_window = WINDOW + 1
    widened = build_causal_lm_from_config(wide, dtype=torch.float64)
    widened.load_state_dict(ref.state_dict())
    assert float((_rlsp_logprobs(widened, packed) - expected).abs().max()) > 1e3 * tol
