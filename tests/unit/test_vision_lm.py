"""rlsp.models.vision_lm on one rank: Qwen2.5-VL and Qwen3-VL on a packed stream equal transformers' own forward.

The tiny models of tests/tiny_vl.py with the same weights: rlsp's VisionLogprobModel on the packed stream of padded
rows with 0, 1 and 2 images (multimodal rope from the model's get_rope_index per row, visual tokens scattered at the
placeholders, Qwen3-VL's deepstack at the visual positions) gives transformers' logprobs (its full forward of the
padded rows, logits -> log_softmax) and the gradients of their sum, vision tower included, within
tests/tolerances.py's bounds; text-only rows give transformers' text forward; a frozen tower gets no gradient and no
optimizer state; malformed image inputs and unsupported combinations are refused by name.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_vl import IMAGE, VL_FAMILIES, hf_logprobs, reference_pair, vl_rows
from tolerances import assert_grads_close, logprob_tol, model_rtol

from rlsp.engine.micro import prepare_micro_batch
from rlsp.engine.optim import OptimSettings, build_optimizer
from rlsp.models.family_checks import check_sp_support, num_heads
from rlsp.models.lm import TokenLogprobModel
from rlsp.models.loading import build_causal_lm_from_config
from rlsp.models.vision_lm import VisionLogprobModel, assign_images

P, R = 22, 6
GRIDS = [[], [[1, 4, 4]], [[1, 2, 4], [1, 4, 6]], [[1, 4, 2]]]


@pytest.fixture(scope="module", params=VL_FAMILIES)
def pair(request):
    """(transformers' model with sdpa attention, rlsp's model with the same weights, config)."""
    return reference_pair(request.param)


def _rlsp_logprobs(model, rows):
    """rlsp's logprobs at every real label position, and the (row, column) of the token each one is predicted from."""
    micro = prepare_micro_batch(rows, P, None, *num_heads(model.lm.config.text_config))
    packed = micro.packed
    out = model(packed.input_ids, packed.position_ids, packed.labels, sp_context=micro.ctx, **micro.multi_modal_kwargs())
    keep = packed.label_mask[:packed.num_real]
    return out["logprobs"][:packed.num_real][keep], packed.row_index[keep], packed.col_index[keep]


def _bound(config, backward: bool) -> float:
    """model_rtol over the text layers and the tower's blocks (a gradient passes through both)."""
    return model_rtol(config, len(GRIDS) * (P + R), backward=backward)


def test_packed_forward_and_gradients_equal_transformers(pair):
    ref, lm, config = pair
    rows = vl_rows(GRIDS, P, R)
    model = VisionLogprobModel(lm)
    lm.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    got, r, c = _rlsp_logprobs(model, rows)
    want = hf_logprobs(ref, rows)[r, c]
    tol = logprob_tol(config.text_config, len(GRIDS) * (P + R), value_scale=float(want.detach().abs().max()))
    assert (got - want).abs().max() <= tol, ((got - want).abs().max(), tol)
    got.sum().backward()
    want.sum().backward()
    grads = {n: p.grad for n, p in lm.named_parameters() if p.grad is not None}
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert any(n.startswith("model.visual.") for n in grads)
    if config.model_type == "qwen3_vl":
        assert any("deepstack" in n for n in grads)
    assert_grads_close(grads, ref_grads, _bound(config, backward=True))


def test_text_only_rows_equal_transformers_text_forward(pair):
    """No image in the rows: no multimodal kwarg reaches the model, and it gives the text positions' forward."""
    ref, lm, config = pair
    rows = vl_rows([[], [], []], P, R, seed=1)
    micro = prepare_micro_batch(rows, P, None, *num_heads(config.text_config))
    assert micro.multi_modal_kwargs() == {}
    with torch.no_grad():
        got, r, c = _rlsp_logprobs(VisionLogprobModel(lm), rows)
        ids, mask = rows["input_ids"], rows["attention_mask"]
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        logits = ref(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        want = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0][r, c]
    tol = logprob_tol(config.text_config, 3 * (P + R), value_scale=float(want.detach().abs().max()))
    assert (got - want).abs().max() <= tol


def test_frozen_tower_gets_no_gradient_or_optimizer_state(pair):
    _, lm, _ = pair
    model = VisionLogprobModel(build_causal_lm_from_config(lm.config), freeze_vision_tower=True)
    got, _, _ = _rlsp_logprobs(model, vl_rows(GRIDS, P, R))
    got.sum().backward()
    visual = list(model.visual.parameters())
    assert all(not p.requires_grad and p.grad is None for p in visual)
    assert all(p.grad is not None for p in model.decoder.layers.parameters())
    optimizer, _ = build_optimizer(model, OptimSettings(lr=1e-3))
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert held and not held & {id(p) for p in visual}


def test_trained_tower_gets_zero_gradients_from_text_only_rows(pair):
    """A rank without images still holds a gradient (zeros) for every tower parameter: FSDP's reduce and AdamW see
    the same parameters whatever the layout."""
    _, lm, _ = pair
    model = VisionLogprobModel(build_causal_lm_from_config(lm.config))
    got, _, _ = _rlsp_logprobs(model, vl_rows([[], []], P, R))
    got.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.visual.parameters())


def test_images_are_balanced_by_patches():
    assert assign_images([16, 8, 24, 8], 2) == [1, 1, 0, 0]  # 24 -> 0, 16 -> 1, 8 -> 1, 8 -> 0 (a tie)
    assert assign_images([4], 4) == [0]
    assert assign_images([], 2) == []


def test_malformed_or_unsupported_inputs_are_refused(pair):
    _, lm, config = pair
    model = VisionLogprobModel(lm)
    rows = vl_rows(GRIDS, P, R)
    rows.meta["multi_modal_inputs"][1] = {**rows.meta["multi_modal_inputs"][1],
                                          "image_grid_thw": torch.tensor([[1, 4, 2]])}
    with pytest.raises(ValueError, match="disagree|image tokens"):
        _rlsp_logprobs(model, rows)
    rows = vl_rows(GRIDS, P, R)
    rows.meta["multi_modal_inputs"][1]["pixel_values_videos"] = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="videos are not supported"):
        _rlsp_logprobs(model, rows)
    rows = vl_rows(GRIDS, P, R)
    rows.tensors["input_ids"][1][rows["input_ids"][1] == IMAGE] = 5  # placeholders lost
    with pytest.raises(ValueError, match="image tokens"):
        _rlsp_logprobs(model, rows)


def test_text_models_and_other_multimodal_types_are_refused(pair):
    _, _, config = pair
    from transformers import LlavaConfig, Qwen2Config

    with pytest.raises(ValueError, match="vision-language families"):
        check_sp_support(LlavaConfig(), 1)
    check_sp_support(config, 4)  # a vision-language config passes its text config's checks
    text_lm = build_causal_lm_from_config(Qwen2Config(vocab_size=64, hidden_size=48, intermediate_size=64,
                                                      num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=2))
    with pytest.raises(ValueError, match="not a vision-language family"):
        VisionLogprobModel(text_lm)
    rows = vl_rows(GRIDS, P, R)
    micro = prepare_micro_batch(rows, P, None, 6, 2)
    packed = micro.packed
    with pytest.raises(ValueError, match="the rows carry images"):
        TokenLogprobModel(text_lm)(packed.input_ids, packed.position_ids, packed.labels, sp_context=micro.ctx,
                                   **micro.multi_modal_kwargs())


def test_tensor_parallelism_is_refused_by_name(pair):
    from rlsp.models.family_checks import check_tp_windowed

    _, _, config = pair
    check_tp_windowed(config, 1)
    for cfg in (config, config.text_config):  # the wrapper's config and the text config rlsp.check reads
        with pytest.raises(ValueError, match="tensor_model_parallel_size=2: .* vision-language model"):
            check_tp_windowed(cfg, 2)


def test_loading_runs_the_text_model_through_ulysses_and_the_tower_through_its_own_attention(pair):
    from rlsp.models.attention import ULYSSES_ATTN_IMPL
    from rlsp.models.vision_inputs import VISION_ATTN_IMPL
    from rlsp.models.vision_lm import build_logprob_model

    _, lm, _ = pair
    assert lm.config.text_config._attn_implementation == ULYSSES_ATTN_IMPL
    assert lm.config.vision_config._attn_implementation == VISION_ATTN_IMPL
    model = build_logprob_model(lm, freeze_vision_tower=False)
    assert type(model) is VisionLogprobModel and model.decoder is lm.model.language_model


def test_the_text_head_refuses_a_vision_language_model(pair):
    _, lm, _ = pair
    with pytest.raises(ValueError, match="build_logprob_model"):
        TokenLogprobModel(lm)


def test_features_follow_the_language_model_rules_in_the_checks(pair):
    """Tiled MLP, lean RMSNorm and LoRA act on the language model only (rlsp.models.vision_lora, tested in
    tests/unit/test_vision_lora.py): the checks apply the text config's family rules (MoE layers refuse tiled MLP)."""
    from rlsp.models.feature_support import feature_errors

    _, _, config = pair
    model = SimpleNamespace(tiled_mlp=SimpleNamespace(enabled=True), lean_rmsnorm=True, lora_rank=8,
                            target_modules="all-linear", exclude_modules=None, lora_adapter_path=None)
    errors = feature_errors(config.text_config, model, "m.")
    moe = config.model_type == "qwen3_vl_moe"
    assert [e.split(":")[0] for e in errors] == (["m.tiled_mlp.enabled=true"] if moe else []), errors
    off = SimpleNamespace(tiled_mlp=SimpleNamespace(enabled=False), lean_rmsnorm=False, lora_rank=0,
                          lora_adapter_path=None)
    assert feature_errors(config.text_config, off, "m.") == []
