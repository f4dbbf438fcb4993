"""rlsp.models.value.VisionValueModel on one rank: the critic over a vision-language model takes the rows' images.

The tiny Qwen2.5-VL and Qwen3-VL of tests/tiny_vl.py: the packed stream of padded rows with 0, 1 and 2 images gives
the value head over transformers' own base-model forward of the padded rows (pixel values, multimodal rope, deepstack),
every real token, and the gradients of the values' sum (vision tower included), within tests/tolerances.py's bounds.
The images reach the values: blanking a row's pixels moves the values after its first image token by far more than
the bound, and leaves text-only rows and the tokens before the image as they were. A frozen tower gets no gradient and
no optimizer state; a text critic refuses images, and `freeze_vision_tower` on a text backbone is refused by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_vl import IMAGE, VL_FAMILIES, hf_image_kwargs, reference_pair, vl_rows
from tolerances import assert_grads_close, assert_tensor_close, model_rtol

from rlsp.engine.micro import prepare_micro_batch
from rlsp.engine.optim import OptimSettings, build_optimizer
from rlsp.models.family_checks import num_heads
from rlsp.models.loading import build_causal_lm_from_config
from rlsp.models.tiny import TinyModelSpec, build_tiny_model
from rlsp.models.value import ValueModel, VisionValueModel, build_value_model

P, R = 22, 6
GRIDS = [[], [[1, 4, 4]], [[1, 2, 4], [1, 4, 6]], [[1, 4, 2]]]
TOKENS = len(GRIDS) * (P + R)


@pytest.fixture(scope="module", params=[f for f in VL_FAMILIES if f != "qwen3_vl_moe"])
def pair(request):
    """(transformers' model with sdpa attention, rlsp's critic over the same weights, config)."""
    ref, lm, config = reference_pair(request.param)
    torch.manual_seed(1)
    return ref, VisionValueModel(lm.model, init_std=0.5), config


def _rlsp_values(model, rows):
    """rlsp's values at every real token of the stream, and that token's (row, column)."""
    micro = prepare_micro_batch(rows, P, None, *num_heads(model.decoder.config))
    packed = micro.packed
    out = model(packed.input_ids, packed.position_ids, packed.labels, sp_context=micro.ctx,
                **micro.multi_modal_kwargs())
    n = packed.num_real
    return out["values"][:n], packed.row_index[:n], packed.col_index[:n]


def _hf_values(ref, head, rows) -> torch.Tensor:
    """The value head over transformers' base-model forward of the padded rows (their images): [B, L]."""
    ids, mask = rows["input_ids"], rows["attention_mask"]
    hidden = ref.model(input_ids=ids, attention_mask=mask, use_cache=False, **hf_image_kwargs(rows)).last_hidden_state
    return F.linear(hidden, head.weight, head.bias)[..., 0]


def test_values_and_gradients_equal_transformers(pair):
    ref, model, config = pair
    rows = vl_rows(GRIDS, P, R)
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    got, r, c = _rlsp_values(model, rows)
    head = torch.nn.Linear(1, 1)  # the critic's head, copied: the reference's gradients stay its own
    head.weight, head.bias = (torch.nn.Parameter(p.detach().clone()) for p in (model.value_head.weight,
                                                                                model.value_head.bias))
    want = _hf_values(ref, head, rows)[r, c]
    assert_tensor_close(got.detach(), want.detach(), model_rtol(config, TOKENS, backward=False))
    got.sum().backward()
    want.sum().backward()
    grads = {n.removeprefix("backbone."): p.grad for n, p in model.named_parameters() if p.grad is not None}
    ref_grads = {n.removeprefix("model."): p.grad for n, p in ref.named_parameters() if p.grad is not None}
    ref_grads.update({f"value_head.{n}": p.grad for n, p in head.named_parameters()})
    assert any(n.startswith("visual.") for n in grads) and "value_head.weight" in grads
    if config.model_type == "qwen3_vl":
        assert any("deepstack" in n for n in grads)
    assert_grads_close(grads, ref_grads, model_rtol(config, TOKENS))


def test_the_images_reach_the_values(pair):
    """Blanked pixels (zeros) change the values from each image row's first image token on, and nothing else."""
    _, model, config = pair
    rows, blank = vl_rows(GRIDS, P, R), vl_rows(GRIDS, P, R)
    for entry in blank.meta["multi_modal_inputs"]:
        if entry is not None:
            entry["pixel_values"] = torch.zeros_like(entry["pixel_values"])
    with torch.no_grad():
        got, r, c = _rlsp_values(model, rows)
        other, _, _ = _rlsp_values(model, blank)
    ids = rows["input_ids"]
    first = {b: int((ids[b] == IMAGE).nonzero()[0]) for b in range(len(GRIDS)) if GRIDS[b]}
    sees = torch.tensor([int(b) in first and int(col) >= first[int(b)] for b, col in zip(r, c)])
    bound = model_rtol(config, TOKENS, backward=False) * float(got.abs().max())
    assert_tensor_close(other[~sees], got[~sees], model_rtol(config, TOKENS, backward=False), float(got.abs().max()))
    moved = (other[sees] - got[sees]).abs()
    assert float(moved.max()) > 1e3 * bound, (float(moved.max()), bound)
    for b in first:  # every image row's values move
        assert float(moved[(r[sees] == b)].max()) > 1e3 * bound, b


def test_frozen_tower_gets_no_gradient_or_optimizer_state(pair):
    _, model, config = pair
    frozen = build_value_model(build_causal_lm_from_config(config).model, freeze_vision_tower=True)
    assert isinstance(frozen, VisionValueModel)
    got, _, _ = _rlsp_values(frozen, vl_rows(GRIDS, P, R))
    got.sum().backward()
    visual = list(frozen.visual.parameters())
    assert all(not p.requires_grad and p.grad is None for p in visual)
    assert all(p.grad is not None for p in frozen.decoder.layers.parameters())
    assert frozen.value_head.weight.grad is not None
    optimizer, _ = build_optimizer(frozen, OptimSettings(lr=1e-3))
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert held and not held & {id(p) for p in visual}


def test_text_critic_refuses_images_and_the_tower_key(tmp_path):
    from rlsp.models.loading import load_backbone

    path = build_tiny_model(TinyModelSpec(vocab_size=64), str(tmp_path / "text"))
    model = build_value_model(load_backbone(path))
    assert type(model) is ValueModel
    with pytest.raises(ValueError, match="is a text model"):
        _rlsp_values(model, vl_rows(GRIDS, P, R))
    with pytest.raises(ValueError, match="freeze_vision_tower=True: the critic's backbone"):
        build_value_model(load_backbone(path), freeze_vision_tower=True)
    with pytest.raises(ValueError, match="not a vision-language family"):
        VisionValueModel(load_backbone(path))


def _check(tmp_path, *overrides: str, capsys) -> tuple[int, str]:
    """`rlsp.check` on the vision-language recipe's settings (tests/e2e: the built-in tiny Qwen2.5-VL, the shapes
    task, hf rollouts, Ulysses 2) with PPO's critic (algorithm.adv_estimator=gae)."""
    from rlsp.check import main as check_main
    from rlsp.data.tasks.shapes import write_shapes_parquet

    train, _ = write_shapes_parquet(str(tmp_path / "data"), n_train=4, n_test=2, image_size=24)
    rc = check_main(["trainer.device=cpu", f"trainer.cache_dir={tmp_path / 'cache'}",
                     f"trainer.default_local_dir={tmp_path / 'run'}", f"data.train_files={train}",
                     "data.val_files=null",
                     "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                     "trainer.total_training_steps=2", "trainer.n_gpus_per_node=2", "data.max_prompt_length=96",
                     "actor_rollout_ref.model.path=builtin://tiny-qwen2.5-vl", "actor_rollout_ref.rollout.name=hf",
                     "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "algorithm.adv_estimator=gae",
                     "critic.ulysses_sequence_parallel_size=2", *overrides])
    return rc, capsys.readouterr().out


def test_check_accepts_the_vision_language_critic_and_refuses_what_is_not_verified(tmp_path, capsys):
    from tiny_vl import write_tiny_vl

    from rlsp.models.tiny_vl import ensure_tiny_vl_model

    rc, out = _check(tmp_path, capsys=capsys)
    assert rc == 0, out
    rc, out = _check(tmp_path, "critic.model.freeze_vision_tower=true", capsys=capsys)
    assert rc == 0, out
    own = ensure_tiny_vl_model(str(tmp_path / "own_vl"))  # the actor's family and image geometry: accepted
    rc, out = _check(tmp_path, f"critic.model.path={own}", capsys=capsys)
    assert rc == 0, out
    rc, out = _check(tmp_path, f"critic.model.path={own}", "critic.tensor_model_parallel_size=2",
                     "critic.ulysses_sequence_parallel_size=1", capsys=capsys)
    assert rc == 2 and "critic.tensor_model_parallel_size=2: the critic's model" in out, out
    other = write_tiny_vl("qwen3_vl", str(tmp_path / "qwen3_vl"))  # another family: its tower reads other inputs
    rc, out = _check(tmp_path, f"critic.model.path={other}", capsys=capsys)
    assert rc == 2 and "does not read the actor's image inputs (model_type: qwen2_5_vl vs qwen3_vl" in out, out
    text = build_tiny_model(TinyModelSpec(), str(tmp_path / "text"))
    rc, out = _check(tmp_path, f"critic.model.path={text}", capsys=capsys)
    assert rc == 0, out  # a text critic values the rows' tokens
    rc, out = _check(tmp_path, f"critic.model.path={text}", "critic.model.freeze_vision_tower=true", capsys=capsys)
    assert rc == 2 and "critic.model.freeze_vision_tower=true: the critic's model" in out, out
