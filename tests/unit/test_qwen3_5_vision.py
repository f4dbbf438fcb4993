"""Qwen3.5 / Qwen3.5-MoE with images on one rank: rlsp's VisionLogprobModel on a packed stream equals transformers.

The tiny hybrid vision-language models of tests/tiny_vl.py (Gated DeltaNet and gated full-attention text layers,
interleaved multimodal rope whose three sections all rotate, a tower without deepstack), built by rlsp with their
tower (`vision_tower=True`) and loaded with transformers' weights: on packed rows with 0, 1 and 2 images the
logprobs equal transformers' own forward of each row alone, and the gradients of their sum (tower included) equal
transformers', within tests/tolerances.py's bounds. By default the wrapper still loads as its text model; a text
model asked for a tower, and ring attention on the hybrid layers, are refused by name.
"""

from __future__ import annotations

import pytest
from tiny_vl import HYBRID_VL_FAMILIES, build_tiny_vl, hf_row_logprobs, hybrid_vl_config, vl_rows
from tolerances import assert_grads_close, decoder_chain, logprob_tol, model_rtol

from rlsp.engine.micro import prepare_micro_batch
from rlsp.models.family_checks import check_ring_support, num_heads
from rlsp.models.loading import build_causal_lm_from_config
from rlsp.models.vision_lm import VisionLogprobModel, build_logprob_model

P, R = 22, 6
GRIDS = [[], [[1, 4, 4]], [[1, 2, 4], [1, 4, 6]], [[1, 4, 2]]]
TOKENS = len(GRIDS) * (P + R)


@pytest.fixture(scope="module", params=HYBRID_VL_FAMILIES)
def pair(request):
    """(transformers' model, rlsp's model with its tower and the same weights, config)."""
    config = hybrid_vl_config(request.param)
    ref = build_tiny_vl(config)
    lm = build_causal_lm_from_config(config, vision_tower=True)
    lm.load_state_dict(ref.state_dict())
    return ref, lm, config


def test_packed_rows_with_images_equal_transformers_per_row(pair):
    ref, lm, config = pair
    model = build_logprob_model(lm)
    assert type(model) is VisionLogprobModel and model.decoder is lm.model.language_model
    rows = vl_rows(GRIDS, P, R)
    micro = prepare_micro_batch(rows, P, None, *num_heads(config.text_config))
    packed = micro.packed
    out = model(packed.input_ids, packed.position_ids, packed.labels, sp_context=micro.ctx, **micro.multi_modal_kwargs())
    keep = packed.label_mask[:packed.num_real]
    got = out["logprobs"][:packed.num_real][keep]
    want = hf_row_logprobs(ref, rows)[packed.row_index[keep], packed.col_index[keep]]
    tol = logprob_tol(decoder_chain(config), TOKENS, value_scale=float(want.detach().abs().max()))
    assert (got - want).abs().max() <= tol, ((got - want).abs().max(), tol)
    lm.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    got.sum().backward()
    want.sum().backward()
    grads = {n: p.grad for n, p in lm.named_parameters() if p.grad is not None}
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys()
    assert any(n.startswith("model.visual.") for n in grads) and any("linear_attn" in n for n in grads)
    assert_grads_close(grads, ref_grads, model_rtol(config, TOKENS))


def test_the_wrapper_loads_text_only_unless_the_tower_is_asked_for(pair):
    from transformers import Qwen2Config

    _, lm, config = pair
    text_lm = build_causal_lm_from_config(config)
    assert not hasattr(text_lm.model, "visual") and type(build_logprob_model(text_lm)) is not VisionLogprobModel
    assert config.text_config._attn_implementation != lm.config.text_config._attn_implementation  # rlsp's copy
    with pytest.raises(ValueError, match="vision_tower=True: qwen2 has no vision tower"):
        build_causal_lm_from_config(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                                num_attention_heads=2, num_key_value_heads=2), vision_tower=True)
    with pytest.raises(ValueError, match="ring_sequence_parallel_size=2: .*linear_attention"):
        check_ring_support(config, 2)

