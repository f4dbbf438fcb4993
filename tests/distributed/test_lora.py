"""LoRA on the policy engine (peft adapters under FSDP2), checked element by element.

* Ulysses 2 and ring 2 reproduce one rank: logprobs with the adapters on and off, loss metrics and
  every adapter gradient;
* a step changes the adapters only (base weights bit-identical) and AdamW holds state for them only;
* the reference (adapters off) equals a separate frozen engine built from the base;
* the merged weights sent to the rollout engine give the trainer's logprobs in a plain HF model;
* a checkpoint (adapters + optimizer only) reloads bit-exactly, also on another layout, and training
  continues exactly as if uninterrupted;
* the export writes a PEFT adapter and a merged HF model with the same logits (1e-5, fp32).
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.distributed as dist
from _launch import layout_dims, run_distributed
from peft import PeftModel
from test_fsdp_engine import LOSS, METRICS, P, _rollout_batch, policy_engine, tolerances
from tolerances import assert_adam_step_close, assert_grads_close, assert_scalars_close, assert_tensor_close
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rlsp.engine.checkpoint import load_engine, save_engine
from rlsp.engine.export import export_hf
from rlsp.engine.fsdp_engine import FSDPEngine
from rlsp.engine.optim import OptimSettings
from rlsp.models.lm import TokenLogprobModel
from rlsp.models.loading import load_causal_lm
from rlsp.models.lora import LORA_ADAPTER_DIR, LoraSettings, apply_lora, is_adapter_param
from rlsp.models.tiny import TinyModelSpec, build_tiny_model
from rlsp.workers.actor_loss import make_actor_loss

pytestmark = pytest.mark.distributed

LORA = LoraSettings(rank=4, alpha=8.0)


def lora_engine(model_path: str, dims, *, lr: float = 1e-2, b_seed: int | None = 0):
    """A LoRA policy engine as the actor builds it; B is drawn from `b_seed` (peft starts it at zero,
    which would make adapters-on and adapters-off indistinguishable)."""
    lm = load_causal_lm(model_path)
    adapters = apply_lora(lm, LORA)
    if b_seed is not None:
        g = torch.Generator().manual_seed(b_seed)
        with torch.no_grad():
            for name, p in lm.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    engine = FSDPEngine(TokenLogprobModel(lm), dims, torch.device("cpu"), optim=OptimSettings(lr=lr, grad_clip=0.0))
    return engine, adapters


def _step(engine: FSDPEngine, batch, micro: int = 3) -> dict[str, float]:
    dims = engine.dims
    shard = batch.chunk(dims.dp_size)[dims.dp_rank]
    count = shard["response_mask"].sum().double().reshape(1)
    dist.all_reduce(count, group=dims.dp_group)
    return engine.train_step(shard, P, micro, make_actor_loss(LOSS, float(count)), temperature=1.0, with_entropy=True)


def _full(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.iter_full_params()}


def _forward_and_grads(rank, world, path, batch, ulysses, ring):
    engine, adapters = lora_engine(path, layout_dims(ulysses=ulysses, ring=ring))
    with adapters.adapters_disabled():
        base_lp = engine.infer(batch, P, 3, "logprobs", temperature=1.0)
    lp = engine.infer(batch, P, 3, "logprobs", temperature=1.0)
    shard = batch.chunk(engine.dims.dp_size)[engine.dims.dp_rank]
    count = shard["response_mask"].sum().double().reshape(1)
    dist.all_reduce(count, group=engine.dims.dp_group)
    engine.optimizer.zero_grad(set_to_none=True)
    metrics = engine.backward_batch(shard, P, 3, make_actor_loss(LOSS, float(count)), temperature=1.0,
                                    with_entropy=True)
    grads = {k: v.clone() for k, v in engine.iter_full_grads()}
    return (base_lp, lp, metrics, grads) if rank == 0 else None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    path = build_tiny_model(spec, str(tmp_path_factory.mktemp("tiny")))
    return path, _rollout_batch(AutoConfig.from_pretrained(path).vocab_size)


@pytest.fixture(scope="module")
def one_rank(tiny):
    path, batch = tiny
    return run_distributed(_forward_and_grads, 1, path, batch, 1, 1)[0]


@pytest.mark.parametrize("world,ulysses,ring", [(2, 2, 1), (2, 1, 2), (2, 1, 1)])
def test_sequence_parallel_lora_equals_one_rank(tiny, one_rank, world, ulysses, ring):
    path, batch = tiny
    base_lp, lp, metrics, grads = run_distributed(_forward_and_grads, world, path, batch, ulysses, ring)[0]
    ref_base, ref_lp, ref_metrics, ref_grads = one_rank
    assert float((ref_lp - ref_base).abs().max()) > 1e-3  # the adapters matter on this batch
    rtol, grad_rtol, scale = tolerances(path)
    assert_tensor_close(lp, ref_lp, rtol, scale)
    assert_tensor_close(base_lp, ref_base, rtol, scale)
    assert_scalars_close(metrics, ref_metrics, METRICS, rtol, scale)
    assert grads.keys() == ref_grads.keys() and all(is_adapter_param(k) for k in grads)
    assert len(grads) == 2 * 7 * 2  # A and B of q, k, v, o, gate, up, down in 2 layers
    assert_grads_close(grads, ref_grads, grad_rtol)


def _step_changes(rank, world, path, batch):
    engine, _ = lora_engine(path, layout_dims(ulysses=world))
    before = _full(engine)
    metrics = _step(engine, batch)
    after = _full(engine)
    state = [(n, {k: v.numel() for k, v in engine.optimizer.state[p].items() if torch.is_tensor(v)})
             for n, p in engine.module.named_parameters() if p in engine.optimizer.state]
    trainable = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    return (before, after, metrics, state, trainable) if rank == 0 else None


def test_step_moves_adapters_only_and_adam_holds_only_their_state(tiny):
    path, batch = tiny
    before, after, metrics, state, trainable = run_distributed(_step_changes, 2, path, batch)[0]
    assert metrics["grad_norm"] > 0
    assert before.keys() == after.keys()
    for name in before:
        if is_adapter_param(name):
            assert not torch.equal(before[name], after[name]), f"{name} did not move"
        else:
            assert torch.equal(before[name], after[name]), f"base weight {name} changed"
    assert trainable and all(is_adapter_param(n) for n in trainable)
    assert sorted(n for n, _ in state) == sorted(trainable)
    assert all(set(s) == {"exp_avg", "exp_avg_sq"} | ({"step"} & set(s)) for _, s in state)


def _reference_vs_frozen(rank, world, path, batch):
    engine, adapters = lora_engine(path, layout_dims(ulysses=2))
    _step(engine, batch)  # adapters trained: the reference must still be the base
    with adapters.adapters_disabled():
        ref = engine.infer(batch, P, 3, "logprobs", temperature=1.0)
    frozen = policy_engine(path, layout_dims(ulysses=2), trainable=False)
    base = frozen.infer(batch, P, 3, "logprobs", temperature=1.0)
    grads_back = all(p.requires_grad for p in adapters.adapter_params())
    policy = engine.infer(batch, P, 3, "logprobs", temperature=1.0)
    return (ref, base, policy, grads_back) if rank == 0 else None


def test_reference_with_adapters_off_equals_a_frozen_base_engine(tiny):
    path, batch = tiny
    ref, base, policy, grads_back = run_distributed(_reference_vs_frozen, 2, path, batch)[0]
    rtol, _, scale = tolerances(path)
    assert_tensor_close(ref, base, rtol, scale)
    assert float((policy - base).abs().max()) > 1e-3 and grads_back


def _merged(rank, world, path, batch):
    engine, adapters = lora_engine(path, layout_dims(ulysses=world))
    _step(engine, batch)
    merged = dict(adapters.merge_for_rollout(engine.iter_full_params()))
    lp = engine.infer(batch, P, 3, "logprobs", temperature=1.0)
    return (merged, lp) if rank == 0 else None


def _hf_response_logprobs(model, batch, b: int) -> torch.Tensor:
    keep = batch["attention_mask"][b].bool()
    ids = batch["input_ids"][b][keep]
    n_resp = int(batch["response_mask"][b].sum())
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids[None]).logits[0].float(), dim=-1)
    return logp[:-1].gather(-1, ids[1:, None])[:, 0][ids.numel() - 1 - n_resp:]


def test_merged_rollout_weights_give_the_trainers_logprobs(tiny):
    """What weight sync sends (base names, B @ A folded in) loaded into the unwrapped HF model."""
    path, batch = tiny
    merged, lp = run_distributed(_merged, 2, path, batch)[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = set(model.state_dict()) | {"lm_head.weight"}
    assert set(merged) == expected
    model.load_state_dict({k: v for k, v in merged.items()}, strict=True)
    rtol, _, scale = tolerances(path)  # B @ A folded in: one more reduction (over the rank) than the forward's
    for b in range(len(batch)):
        n_resp = int(batch["response_mask"][b].sum())
        assert_tensor_close(_hf_response_logprobs(model, batch, b), lp[b, :n_resp], rtol, scale)


def _whole(t):
    """A copy of the full tensor: gathered from a DTensor (FSDP), or the replicated model's own tensor."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()


def _save_after_step(rank, world, path, batch, ckpt):
    engine, adapters = lora_engine(path, layout_dims(ulysses=world))
    _step(engine, batch)
    save_engine(engine, os.path.join(ckpt, "actor"))
    if rank == 0:
        assets = os.path.join(ckpt, "actor", "huggingface")
        engine.config.save_pretrained(assets)
        AutoTokenizer.from_pretrained(path).save_pretrained(assets)
        adapters.save_config(os.path.join(assets, LORA_ADAPTER_DIR), base_model=path)
    state = engine.state_dict()
    saved = {k: _whole(v) for k, v in state["model"].items()}
    lp = engine.infer(batch, P, 3, "logprobs", temperature=1.0)
    metrics = _step(engine, batch)  # the uninterrupted run's next step
    continued = (_full(engine), _grads(engine), metrics["lr"])
    return (saved, lp, continued) if rank == 0 else None


def _grads(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.iter_full_grads()}


def _adam_state(engine: FSDPEngine) -> dict[str, dict]:
    """Per trained parameter (HF name), AdamW's state as full tensors."""
    return {name: {k: _whole(v) for k, v in engine.optimizer.state[p].items()}
            for name, p in engine.hf_root.named_parameters() if p in engine.optimizer.state}


def _load_and_step(rank, world, path, batch, ckpt, ulysses):
    engine, _ = lora_engine(path, layout_dims(ulysses=ulysses), b_seed=7)  # other init: the load must overwrite it
    load_engine(engine, os.path.join(ckpt, "actor"))
    loaded = {k: _whole(v) for k, v in engine.state_dict()["model"].items()}
    state = _adam_state(engine)  # the saved run's state before its second step
    _step(engine, batch)
    params = (_full(engine), _grads(engine), state)
    return (loaded, params, engine.scheduler.state_dict()["last_epoch"]) if rank == 0 else None


@pytest.fixture(scope="module")
def checkpoint(tiny, tmp_path_factory):
    path, batch = tiny
    ckpt = str(tmp_path_factory.mktemp("lora_ckpt"))
    saved, lp, continued = run_distributed(_save_after_step, 2, path, batch, ckpt)[0]
    return ckpt, saved, lp, continued


@pytest.mark.parametrize("world,ulysses", [(2, 2), (1, 1)])
def test_checkpoint_holds_adapters_and_resumes_exactly(tiny, checkpoint, world, ulysses):
    path, batch = tiny
    ckpt, saved, _, continued = checkpoint
    assert saved and all(is_adapter_param(k) for k in saved)
    meta = torch.distributed.checkpoint.FileSystemReader(os.path.join(ckpt, "actor")).read_metadata()
    stored = {k for k in meta.state_dict_metadata if k.startswith("model.")}
    assert stored == {f"model.{k}" for k in saved}  # no base weight in the checkpoint
    opt = {k for k in meta.state_dict_metadata if k.startswith("optimizer.state.")}
    assert opt and all(is_adapter_param(k) for k in opt)
    loaded, (params, grads, state), last_epoch = run_distributed(_load_and_step, world, path, batch, ckpt, ulysses)[0]
    (continued, continued_grads, lr) = continued
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert last_epoch == 2 and params.keys() == continued.keys()
    if world == 2:  # same layout: bit-exact
        assert all(torch.equal(params[k], continued[k]) for k in params)
    else:  # one rank sums the second step's gradients in another order; the state before it is the same
        assert state.keys() == grads.keys() and all(int(s["step"]) == 1 for s in state.values())
        assert_adam_step_close(params, continued, grads, continued_grads, lr, states=state)


@pytest.fixture(scope="module")
def exported(checkpoint, tmp_path_factory):
    return export_hf(checkpoint[0], str(tmp_path_factory.mktemp("export") / "hf"))


def test_export_writes_adapter_and_merged_model_with_equal_logits(tiny, checkpoint, exported):
    path, batch = tiny
    _, _, lp, _ = checkpoint
    out = exported
    adapter_dir = os.path.join(out, LORA_ADAPTER_DIR)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(adapter_dir))
    assert json.load(open(os.path.join(adapter_dir, "adapter_config.json")))["r"] == LORA.rank
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), adapter_dir).eval()
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = batch["input_ids"][:, :][batch["attention_mask"].bool()].reshape(1, -1)
    with torch.no_grad():
        peft_logits, merged_logits = peft(input_ids=ids).logits, merged(input_ids=ids).logits
    rtol, _, scale = tolerances(path)
    assert_tensor_close(merged_logits, peft_logits, rtol)
    for name, w in base.named_parameters():  # layers without an adapter are the base's, bit for bit
        if not any(t in name for t in ("proj.weight",)):
            assert torch.equal(w, merged.state_dict()[name]), name
    for b in range(len(batch)):
        n_resp = int(batch["response_mask"][b].sum())
        assert_tensor_close(_hf_response_logprobs(merged, batch, b), lp[b, :n_resp], rtol, scale)


def _from_adapter(rank, world, path, batch, adapter_dir):
    lm = load_causal_lm(path)
    adapters = apply_lora(lm, LoraSettings(rank=0, alpha=1.0, adapter_path=adapter_dir))
    engine = FSDPEngine(TokenLogprobModel(lm), layout_dims(ulysses=world), torch.device("cpu"),
                        optim=OptimSettings(lr=1e-2, grad_clip=0.0))
    lp = engine.infer(batch, P, 3, "logprobs", temperature=1.0)
    metrics = _step(engine, batch)
    trainable = sorted(n for n, p in engine.module.named_parameters() if p.requires_grad)
    return (lp, metrics, trainable, adapters.config.r) if rank == 0 else None


def test_continue_from_a_saved_adapter(tiny, checkpoint, exported):
    """actor_rollout_ref.model.lora_adapter_path: the exported PEFT adapter, loaded on the base at
    Ulysses 2, gives the logprobs of the run that saved it and trains on."""
    path, batch = tiny
    _, saved, lp, _ = checkpoint
    adapter_dir = os.path.join(exported, LORA_ADAPTER_DIR)
    loaded_lp, metrics, trainable, r = run_distributed(_from_adapter, 2, path, batch, adapter_dir)[0]
    rtol, _, scale = tolerances(path)
    assert_tensor_close(loaded_lp, lp, rtol, scale)
    assert r == LORA.rank and metrics["grad_norm"] > 0
    assert trainable == sorted(saved)
    with pytest.raises(ValueError, match="lora_rank=8 but the adapter"):
        apply_lora(load_causal_lm(path), LoraSettings(rank=8, alpha=1.0, adapter_path=adapter_dir))


def _bf16_step(rank, world, path, batch):
    lm = load_causal_lm(path, dtype=torch.bfloat16)  # as the actor loads the base under LoRA
    adapters = apply_lora(lm, LORA)
    engine = FSDPEngine(TokenLogprobModel(lm), layout_dims(ulysses=world), torch.device("cpu"),
                        compute_dtype=torch.bfloat16, optim=OptimSettings(lr=1e-2, grad_clip=0.0))
    before = _full(engine)
    metrics = _step(engine, batch)
    after = _full(engine)
    dtypes = {n: p.dtype for n, p in engine.module.named_parameters()}
    state = {v.dtype for s in engine.optimizer.state.values() for k, v in s.items() if k != "step"}
    return (before, after, metrics, dtypes, state, len(adapters.adapter_params())) if rank == 0 else None


def test_bf16_compute_keeps_fp32_adapter_masters_and_a_bf16_base(tiny):
    """The GPU setting on CPU: base weights stored in bf16 (frozen), adapters and their AdamW state in
    fp32, FSDP2 casting both to bf16 for compute; a step moves the adapters only (from peft's B = 0)."""
    path, batch = tiny
    before, after, metrics, dtypes, state, n_adapters = run_distributed(_bf16_step, 2, path, batch)[0]
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["grad_norm"] > 0
    assert n_adapters == 28 and state == {torch.float32}
    for name, dtype in dtypes.items():
        assert dtype == (torch.float32 if is_adapter_param(name) else torch.bfloat16), (name, dtype)
    for name in before:  # B starts at zero (peft), so the first step moves B only (A's gradient is zero)
        assert torch.equal(before[name], after[name]) != (".lora_B." in name), name
