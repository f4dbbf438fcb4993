"""LoRA on the fused-expert MoE families trains exactly under Ulysses (rlsp/models/lora_targets.py, lora_experts.py).

qwen3_moe with target_modules=[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj] (attention and the fused
experts through peft's ParamWrapper: gate_up_proj at rank 2r, down_proj at rank r) and glm4_moe with all-linear
(attention, the dense first layer's MLP and the shared expert), tiny models of tests/tiny_moe.py `write_exact_moe`
(6 q / 2 kv heads; routing margins checked), go through the FSDP2 policy engine with LoRA as the actor builds it (rank 4, B drawn at random: peft's
B = 0 would make adapters on and off the same function). One launch per layout runs both families. At Ulysses 2
the loss metrics, every adapter gradient (the experts' included) and the AdamW step equal one process's within
tests/tolerances.py's bounds; the step moves the adapters only (experts, routers and every base weight
bit-identical); with the adapters off (the reference policy) the logprobs equal a frozen engine built from the base
model, and with them on they differ from it; a fresh engine resuming from the checkpoint holds the trained weights
bit for bit; rlsp.export of the trained checkpoint gives a merged HF model with the engine's logprobs, whose every
tensor equals the trained engine's `merge_for_rollout` bit for bit, and the rollout weight sync's checkpoint names
(rlsp.rollout.moe_names) are exactly the export's.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from _launch import layout_dims, run_distributed
from safetensors import safe_open
from test_fsdp_engine import LOSS, LR, P, _assert_same_step, policy_engine, tolerances
from test_lora import _hf_response_logprobs
from test_moe_exact import margin_checked_batch
from tiny_moe import write_exact_moe
from tolerances import assert_tensor_close
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlsp.engine.checkpoint import load_engine, save_engine
from rlsp.engine.export import export_hf
from rlsp.engine.fsdp_engine import FSDPEngine
from rlsp.engine.optim import OptimSettings
from rlsp.models.lm import TokenLogprobModel
from rlsp.models.loading import load_causal_lm
from rlsp.models.lora import LORA_ADAPTER_DIR, LoraSettings, apply_lora, is_adapter_param
from rlsp.rollout.moe_names import build_checkpoint_names
from rlsp.workers.actor_loss import make_actor_loss
from rlsp.workers.ppo_loop import global_counts

pytestmark = pytest.mark.distributed

FAMILIES = ("qwen3_moe", "glm4_moe")
LORA = {"qwen3_moe": LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj",
                                                                    "gate_proj", "up_proj", "down_proj")),
        "glm4_moe": LoraSettings(rank=4, alpha=8.0)}


def _lora_engine(path: str, dims, family: str, seed: int = 0):
    lm = load_causal_lm(path)
    torch.manual_seed(seed)  # peft draws A from the global generator
    adapters = apply_lora(lm, LORA[family])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    engine = FSDPEngine(TokenLogprobModel(lm), dims, torch.device("cpu"), optim=OptimSettings(lr=LR, grad_clip=0.0))
    return engine, adapters


def _one_family(family: str, path: str, batch, dims, micro: int, ckpt: str | None) -> dict:
    engine, adapters = _lora_engine(path, dims, family)
    with adapters.adapters_disabled():
        reference = engine.infer(batch, P, micro, "logprobs", temperature=1.0)
    base = policy_engine(path, dims, trainable=False).infer(batch, P, micro, "logprobs", temperature=1.0)
    policy = engine.infer(batch, P, micro, "logprobs", temperature=1.0)
    before = {k: v.clone() for k, v in engine.iter_full_params()}
    shard = batch.chunk(dims.dp_size)[dims.dp_rank]
    engine.optimizer.zero_grad(set_to_none=True)
    metrics = engine.backward_batch(shard, P, micro, make_actor_loss(LOSS, *global_counts(shard, dims.dp_group)),
                                    None, temperature=1.0, with_entropy=True)
    grads = {k: v.clone() for k, v in engine.iter_full_grads()}
    engine.optimizer.step()
    after = {k: v.clone() for k, v in engine.iter_full_params()}
    if ckpt is not None:  # the trained adapters as a checkpoint, for the export
        save_engine(engine, os.path.join(ckpt, "actor"))
        if torch.distributed.get_rank() == 0:
            assets = os.path.join(ckpt, "actor", "huggingface")
            engine.config.save_pretrained(assets)
            AutoTokenizer.from_pretrained(path).save_pretrained(assets)
            adapters.save_config(os.path.join(assets, LORA_ADAPTER_DIR), base_model=path)
    trained = engine.infer(batch, P, micro, "logprobs", temperature=1.0)
    rollout = {k: v.clone() for k, v in adapters.merge_for_rollout(engine.iter_full_params())}  # the weight sync's
    resumed = None
    if ckpt is not None:  # resume: a fresh engine (other adapter init) loads the checkpoint
        again, _ = _lora_engine(path, dims, family, seed=7)
        load_engine(again, os.path.join(ckpt, "actor"))
        resumed = {k: v.clone() for k, v in again.iter_full_params()}
    return dict(step=(metrics, grads, after), before=before, reference=reference, base=base, policy=policy,
                trained=trained, rollout=rollout, resumed=resumed)


def _run_families(rank: int, world: int, models: dict, sp: int, micro: int, ckpts: dict | None = None):
    dims = layout_dims(ulysses=sp)
    out = {family: _one_family(family, path, batch, dims, micro, ckpts and ckpts[family]) for family, (path, batch) in
           models.items()}
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    out = {}
    for family in FAMILIES:
        path = write_exact_moe(family, str(tmp_path_factory.mktemp(family)))
        out[family] = (path, margin_checked_batch(path, family))
    return out


@pytest.fixture(scope="module")
def one_process(models) -> dict:
    return run_distributed(_run_families, 1, models, 1, 8)[0]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    return {family: str(tmp_path_factory.mktemp(f"{family}_ckpt")) for family in FAMILIES}


@pytest.fixture(scope="module")
def ulysses_2(models, checkpoints) -> dict:
    return run_distributed(_run_families, 2, models, 2, 3, checkpoints)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_ulysses_2_lora_step_equals_one_process(models, one_process, ulysses_2, family):
    path, _ = models[family]
    got, ref = ulysses_2[family], one_process[family]
    metrics, grads, after = got["step"]
    assert grads and all(is_adapter_param(k) for k in grads) and grads.keys() == ref["step"][1].keys()
    assert not any(".mlp.gate." in k for k in grads)  # routers stay unadapted
    experts = {k.split(".mlp.experts.")[1] for k in grads if ".mlp.experts." in k}
    assert experts == ({f"{w}lora_{ab}.default.weight" for w in ("", "base_layer.") for ab in "AB"}
                       if family == "qwen3_moe" else set())
    _assert_same_step(got["step"], ref["step"], path)
    for name, before in got["before"].items():  # only the adapters move
        assert torch.equal(before, after[name]) != is_adapter_param(name), name
    rtol, _, scale = tolerances(path)
    assert_tensor_close(got["policy"], ref["policy"], rtol, scale)
    assert got["resumed"].keys() == after.keys() and all(torch.equal(t, after[k]) for k, t in got["resumed"].items())


@pytest.mark.parametrize("layout", ["one_process", "ulysses_2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_reference_with_adapters_off_equals_the_base_model(models, family, layout, request):
    path, _ = models[family]
    got = request.getfixturevalue(layout)[family]
    rtol, _, scale = tolerances(path)
    assert_tensor_close(got["reference"], got["base"], rtol, scale)
    assert float((got["policy"] - got["base"]).abs().max()) > 1e-3  # the adapters matter on this batch


@pytest.mark.parametrize("family", FAMILIES)
def test_export_merges_the_trained_adapters(models, checkpoints, ulysses_2, family, tmp_path):
    """rlsp.export of the Ulysses 2 checkpoint: the merged HF model (routers the base's, bit for bit; experts too
    unless adapted) gives the trained engine's logprobs, holds the trained engine's merge_for_rollout tensors bit for
    bit, and the rollout weight sync's checkpoint names of them are the export's."""
    path, batch = models[family]
    out = export_hf(checkpoints[family], str(tmp_path / "hf"))
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with open(os.path.join(out, LORA_ADAPTER_DIR, "adapter_config.json")) as f:
        assert json.load(f)["base_model_name_or_path"] == path
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for name, w in base.named_parameters():
        if ".experts." in name or ".mlp.gate." in name:
            assert torch.equal(w, merged.get_parameter(name)) != (family == "qwen3_moe" and ".experts." in name), name
    rollout = ulysses_2[family]["rollout"]
    assert rollout.keys() == {n for n, _ in merged.named_parameters()}
    assert all(torch.equal(t, merged.get_parameter(n)) for n, t in rollout.items())
    synced = dict(build_checkpoint_names(merged.config)(rollout.items()))
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        buffers = {n for n, _ in merged.named_buffers()}  # glm4_moe's e_score_correction_bias: not trained, not synced
        assert synced.keys() == set(f.keys()) - buffers and all(torch.equal(t, f.get_tensor(k)) for k, t in synced.items())
    rtol, _, scale = tolerances(path)
    lp = ulysses_2[family]["trained"]
    for b in range(len(batch)):
        n_resp = int(batch["response_mask"][b].sum())
        assert_tensor_close(_hf_response_logprobs(merged, batch, b), lp[b, :n_resp], rtol, scale)
