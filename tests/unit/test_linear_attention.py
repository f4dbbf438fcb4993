"""Gated DeltaNet (linear_attention) layers of Qwen3-Next / Qwen3.5 (text) in rlsp's packed forward.

- A tiny model of each family (tests/tiny_linear.py: linear and gated full-attention layers, 2 key heads read by
  4 value heads; Qwen3-Next with a sparse MoE) through rlsp's packed one-rank forward equals transformers' own
  forward of each row alone, every logprob: the conv window and the recurrent state restart at every row
  (without the reset the rows after the first move far beyond the bound, checked too).
- The swap keeps the parameters: same objects, same state_dict keys in the same order.
- The one-pass masked conv of the accelerator path equals transformers' conv run per segment (values, gradients).
- rlsp.check-level refusals name linear_attention: ring > 1 (tp 2 splits them by key-head groups: accepted here,
  tests/unit/test_tp_linear_support.py for the legal sizes).
Bounds: tests/tolerances.py.
"""

from __future__ import annotations

import pytest
import torch
from tiny_linear import FAMILIES, HEADS, linear_config
from tolerances import assert_tensor_close, logprob_tol, roundoff_rtol
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn

import rlsp.models.linear_attention as linear_attention
from rlsp.data.packing import pack_sequences
from rlsp.models.family_checks import check_ring_support, check_sp_support, check_tp_windowed
from rlsp.models.lm import TokenLogprobModel
from rlsp.models.loading import build_causal_lm_from_config
from rlsp.parallel.tp_checks import check_tp_support
from rlsp.parallel.ulysses import build_sp_context

LENS = (70, 13, 5)  # the first row spans two of the delta rule's 64-token chunks
VOCAB = 50


def _packed_logprobs(model, ids, mask):
    packed = pack_sequences(ids, mask)
    with torch.no_grad():
        out = TokenLogprobModel(model)(packed.input_ids, packed.position_ids, packed.labels,
                                       build_sp_context(None, packed, *HEADS))["logprobs"]
    return out[packed.label_mask.bool()]


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_linear_attention_equals_each_row_alone(family, monkeypatch) -> None:
    config = linear_config(family, vocab=VOCAB)
    torch.manual_seed(0)
    model = build_causal_lm_from_config(config)
    ref = AutoModelForCausalLM.from_config(config)
    ref.load_state_dict(model.state_dict())
    swapped = [layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn")]
    assert len(swapped) == 2 and all(isinstance(m, linear_attention.UlyssesGatedDeltaNet) for m in swapped)
    assert list(model.state_dict()) == list(ref.state_dict())
    width = max(LENS)
    ids = torch.randint(1, VOCAB, (len(LENS), width), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(width)[None, :] < torch.tensor(LENS)[:, None]).long()
    rows = []
    with torch.no_grad():
        for b, n in enumerate(LENS):
            logp = ref(input_ids=ids[b:b + 1, :n]).logits[0].log_softmax(-1)
            rows.append(logp[:n - 1].gather(-1, ids[b, 1:n, None])[:, 0])
    expected = torch.cat(rows)
    got = _packed_logprobs(model, ids, mask)
    tol = logprob_tol(config, sum(LENS))
    err = float((got - expected).abs().max())
    assert got.shape == expected.shape and err <= tol, (err, tol)
    # one segment for the whole stream (no reset at row boundaries): the later rows move far beyond the bound
    monkeypatch.setattr(linear_attention, "_segments", lambda ctx: [(0, ctx.total_len)])
    leaked = _packed_logprobs(model, ids, mask)
    assert float((leaked - expected)[LENS[0] - 1:].abs().max()) > 1e3 * tol


@pytest.mark.parametrize("family", FAMILIES)
def test_linear_layers_refuse_ring_by_name_and_take_tp(family) -> None:
    config = linear_config(family, vocab=VOCAB)
    for sp in (1, 2, 3, 4):
        check_sp_support(config, sp)  # uneven and idle key-head groups are legal
    with pytest.raises(ValueError, match="ring_sequence_parallel_size=2.*linear_attention"):
        check_ring_support(config, 2)
    check_tp_windowed(config, 2)
    check_tp_support(config, 2)  # 4 q / 2 kv heads, 2 key-head groups
    other = linear_config(family, vocab=VOCAB)
    other.model_type = "other_hybrid"
    with pytest.raises(ValueError, match="linear_attention"):
        check_sp_support(other, 1)


def test_masked_segment_conv_equals_transformers_conv_per_segment() -> None:
    lens, C, K = (7, 1, 3, 12), 6, 4  # segments shorter and longer than the kernel
    ids = torch.ones(len(lens), max(lens), dtype=torch.long)
    mask = (torch.arange(max(lens))[None, :] < torch.tensor(lens)[:, None]).long()
    ctx = build_sp_context(None, pack_sequences(ids, mask), *HEADS)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(lens), C, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(C, K, generator=gen, dtype=torch.float64, requires_grad=True)
    got = linear_attention.masked_segment_conv(x, w, None, ctx)
    bounds = torch.tensor((0, *lens)).cumsum(0).tolist()
    ref = torch.cat([causal_conv1d_fn(x[s:e].t()[None], w)[0].t() for s, e in zip(bounds[:-1], bounds[1:])])
    rtol = roundoff_rtol(reduction=K, stages=1, dtype=torch.float64)
    assert_tensor_close(got.detach(), ref.detach(), rtol)
    weights = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    for g, r in zip(torch.autograd.grad((got * weights).sum(), (x, w)), torch.autograd.grad((ref * weights).sum(), (x, w))):
        assert_tensor_close(g, r, 2 * rtol)
