"""The local-tensor tp blocks (multi-latent attention, Gated DeltaNet) save their input's shard, not the gathered input.

tp=2 over gloo, fp32, sequence-parallel activations, four tiny models in one launch: deepseek_v3 (q latent: q_a_proj
reads the block input), deepseek_v2 without a q latent (q_proj reads it) and with kv_a_proj_with_mqa's bias,
qwen3_next (fused in_proj_qkvz / in_proj_ba, tp shards multiplied with F.linear) and qwen3_5_text (in_proj_qkv
replicated: F.linear on rows sliced per rank; in_proj_z/b/a sharded). The reference of each mode (plain, activation
offload, gradient checkpointing) is the same model in the same mode with the blocks' savers disabled (autograd keeps
the gathered input [1, S, h]): every gradient element must be bit-identical to it (backward re-gathers the same bytes;
nothing is summed differently); plain also against a forward with saved-tensor hooks disabled, as
tests/distributed/test_tp_sp_saved.py does for the DTensor blocks. (Offload alone is not bit-identical to plain for
these models, saver or not: it saves contiguous host copies, and a strided view restored contiguous can take another
summation order in backward; hence the per-mode reference.)

What each MLA / Gated DeltaNet block saves for backward, from its input: the storages of its input shard [1, s, h]
(s = S / tp) and of its gathered input, seen by the block's forward pre-hook (its DTensor call, then functional_call's
local re-entry), kept alive so that addresses stay unique; a recording hook pair around the forward sees what is
saved (the saver hands it the shard). The bytes of those storages among the saved are S * h * 4 per block with the
savers disabled and s * h * 4 with them: exact integer counts, a factor tp. Backward all-gathers once per block call
(under checkpointing too: the recomputation gathers through the block's own all-gather, not the saver's), never
with the savers disabled.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import run_distributed  # noqa: E402
from tiny_deepseek import deepseek_config  # noqa: E402
from tiny_linear import linear_config  # noqa: E402

from rlsp.data.packing import pack_sequences  # noqa: E402
from rlsp.engine.offload import offload_saved_tensors  # noqa: E402
from rlsp.models.lm import TokenLogprobModel  # noqa: E402
from rlsp.models.loading import build_causal_lm_from_config  # noqa: E402
from rlsp.parallel.tensor_parallel import apply_tensor_parallel  # noqa: E402
from rlsp.parallel.tp_checks import local_head_counts  # noqa: E402
from rlsp.parallel.ulysses import build_sp_context  # noqa: E402

pytestmark = pytest.mark.distributed

VOCAB, TP = 50, 2
ROWS = (7, 13, 5, 10)
MODES = ("plain", "offload", "checkpointing")
CONFIGS = {  # family -> (config, the decoder layer's attribute holding the block under test)
    "deepseek_v3": (lambda: deepseek_config("v3", vocab=VOCAB), "self_attn"),
    "deepseek_v2": (lambda: deepseek_config("v2", vocab=VOCAB, q_lora_rank=None, attention_bias=True), "self_attn"),
    "qwen3_next": (lambda: linear_config("qwen3_next", vocab=VOCAB, initializer_range=0.08), "linear_attn"),
    "qwen3_5_text": (lambda: linear_config("qwen3_5_text", vocab=VOCAB, initializer_range=0.08), "linear_attn"),
}


def _model(family: str) -> tuple[TokenLogprobModel, list[nn.Module]]:
    """The tiny model of `family` and its blocks under test (the layers that have the attribute)."""
    config, attr = CONFIGS[family]
    torch.manual_seed(0)
    model = TokenLogprobModel(build_causal_lm_from_config(config()))
    blocks = [getattr(layer, attr) for layer in model.decoder.layers if hasattr(layer, attr)]
    return model, blocks


def _forward(model: TokenLogprobModel) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (len(ROWS), max(ROWS)), generator=gen)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(ROWS):
        mask[b, :n] = 1
    packed = pack_sequences(ids, mask, pad_to_multiple=TP)
    q, kv = local_head_counts(model.decoder.config, TP)
    weights = model.tp_info.local_tokens(torch.randn(packed.total_len, generator=gen) * packed.label_mask)
    ctx = build_sp_context(None, packed, q, kv)
    out = model(packed.input_ids, packed.position_ids, packed.labels, ctx, temperature=0.7)["logprobs"]
    return (out * weights).sum()


def _grads(model: TokenLogprobModel, mode: str) -> dict[str, torch.Tensor]:
    contexts = {"hooks_disabled": lambda: torch.autograd.graph.disable_saved_tensors_hooks("reference: autograd's"),
                "offload": lambda: offload_saved_tensors(model, torch.device("cpu"))}
    model.zero_grad(set_to_none=True)
    with contexts.get(mode, contextlib.nullcontext)():
        loss = _forward(model)
    loss.backward()
    return {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone() for n, p in model.named_parameters()}


def _enable(savers: list[Any], enabled: bool) -> None:
    for saver in savers:
        saver.enabled = enabled


def _record_inputs(blocks: list[nn.Module], alive: list[torch.Tensor]) -> tuple[list[dict[str, int]], list[Any]]:
    """Hooks recording each block's input storages: the DTensor call's local shard, then functional_call's
    re-entry with the gathered local tensor. Returns (per block {'shard': ptr, 'gathered': ptr}, hook handles)."""
    seen: list[dict[str, int]] = [{} for _ in blocks]

    def hook(i: int, args: tuple, kwargs: dict) -> None:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        local = hidden.to_local() if isinstance(hidden, DTensor) else hidden
        alive.append(local)
        seen[i]["shard" if isinstance(hidden, DTensor) else "gathered"] = local.untyped_storage().data_ptr()

    handles = [b.register_forward_pre_hook(lambda m, a, k, i=i: hook(i, a, k), with_kwargs=True)
               for i, b in enumerate(blocks)]
    return seen, handles


def _input_bytes_saved(model: TokenLogprobModel, blocks: list[nn.Module]) -> list[int]:
    """Per block: bytes of the block input's storages (shard or gathered) among the tensors saved for backward."""
    alive: list[torch.Tensor] = []
    seen, handles = _record_inputs(blocks, alive)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _forward(model)
    for h in handles:
        h.remove()
    storages = {}
    for t in saved:
        local = t._local_tensor if isinstance(t, DTensor) else t
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    assert all(len(s) == 2 for s in seen), seen
    return [sum(storages.get(ptr, 0) for ptr in s.values()) for s in seen]


def _compare(model: TokenLogprobModel, savers: list[Any], mode: str, out: dict[str, Any]) -> None:
    """Gradients of `mode` with the savers against the savers disabled: parameters differing in any bit, and
    backward's re-gathers (with, without)."""
    counts = []
    for enabled in (False, True):
        _enable(savers, enabled)
        before = sum(s.regathers for s in savers)
        grads = _grads(model, mode)
        counts.append(sum(s.regathers for s in savers) - before)
        if not enabled:
            reference = grads
    out[mode] = [n for n in reference if not torch.equal(grads[n], reference[n])]
    out["regathers"][mode] = tuple(counts)


def _family(family: str, mesh: Any) -> dict[str, Any]:
    model, blocks = _model(family)
    apply_tensor_parallel(model, mesh, sequence_parallel=True)
    savers = [b.tp_input_saver for b in blocks]
    hooks_off = _grads(model, "hooks_disabled")
    out: dict[str, Any] = {"regathers": {}, "blocks": len(blocks), "grads": len(hooks_off)}
    for mode in MODES:
        if mode == "checkpointing":
            model.decoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        _compare(model, savers, mode, out)
        if mode == "plain":
            grads = _grads(model, mode)
            out["hooks_disabled"] = [n for n in hooks_off if not torch.equal(grads[n], hooks_off[n])]
    model.decoder.gradient_checkpointing_disable()
    _enable(savers, False)
    out["bytes_reference"] = _input_bytes_saved(model, blocks)
    _enable(savers, True)
    out["bytes_saved"] = _input_bytes_saved(model, blocks)
    out["hidden"] = model.decoder.config.hidden_size
    return out


def _worker(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))["tp"]
    out = {family: _family(family, mesh) for family in CONFIGS}
    dist.barrier()
    return out


def test_mla_and_gated_deltanet_save_the_shard_regather_once_per_block_and_gradients_are_bit_identical() -> None:
    results = run_distributed(_worker, TP)
    tokens = sum(ROWS) + (-sum(ROWS)) % TP
    for rank, by_family in enumerate(results):
        assert set(by_family) == set(CONFIGS)
        for family, res in by_family.items():
            where = (rank, family)
            assert res["blocks"] == (3 if family.startswith("deepseek") else 2) and res["grads"] > 10, (where, res)
            for mode in (*MODES, "hooks_disabled"):
                assert res[mode] == [], (where, mode, res[mode])  # parameters whose gradient differs in any bit
            full, shard = tokens * res["hidden"] * 4, tokens // TP * res["hidden"] * 4  # fp32 [1, S, h], [1, s, h]
            assert res["bytes_reference"] == [full] * res["blocks"], (where, res)
            assert res["bytes_saved"] == [shard] * res["blocks"], (where, res)
            assert res["regathers"] == dict.fromkeys(MODES, (0, res["blocks"])), (where, res)
