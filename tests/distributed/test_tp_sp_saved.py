"""Sequence-parallel TP saves each block's input shard, not the all-gathered input, and stays exact.

tp=2 over gloo, fp32, a tiny Qwen2 head model with sequence-parallel activations. The reference is the
same tp model whose forward runs with saved-tensor hooks disabled, so autograd keeps the gathered
input as it would without rlsp.parallel.tp_sp: every gradient element must be bit-identical to it
(re-gathering copies the same bytes; nothing is summed differently), also under gradient checkpointing
(recomputation) and under activation offload (the shard travels through the offload's hooks). A
recording hook pair around the forward sees what is saved: no tensor sharing storage with a block's
gathered input (kept alive by the test so that addresses stay unique), and each block's [1, S/tp, h]
shard exactly once. Backward all-gathers once per block (twice per block under checkpointing: the
recomputation, then the weight gradients).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import Qwen2Config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import run_distributed  # noqa: E402

from rlsp.data.packing import pack_sequences  # noqa: E402
from rlsp.engine.offload import offload_saved_tensors  # noqa: E402
from rlsp.models.lm import TokenLogprobModel  # noqa: E402
from rlsp.models.loading import build_causal_lm_from_config  # noqa: E402
from rlsp.parallel.tensor_parallel import apply_tensor_parallel  # noqa: E402
from rlsp.parallel.tp_checks import local_head_counts  # noqa: E402
from rlsp.parallel.ulysses import build_sp_context  # noqa: E402

VOCAB, HIDDEN, LAYERS, TP = 50, 32, 3, 2
ROWS = (7, 13, 5, 10)


def _model() -> TokenLogprobModel:
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.2)
    torch.manual_seed(0)
    return TokenLogprobModel(build_causal_lm_from_config(config))


def _batch(model: TokenLogprobModel) -> tuple[Any, Any, torch.Tensor]:
    """(packed stream, sp context, this rank's per-token loss weights) of the test batch."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (len(ROWS), max(ROWS)), generator=gen)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(ROWS):
        mask[b, :n] = 1
    packed = pack_sequences(ids, mask, pad_to_multiple=TP)
    q, kv = local_head_counts(model.decoder.config, TP)
    weights = model.tp_info.local_tokens(torch.randn(packed.total_len, generator=gen) * packed.label_mask)
    return packed, build_sp_context(None, packed, q, kv), weights


def _forward(model: TokenLogprobModel) -> torch.Tensor:
    packed, ctx, weights = _batch(model)
    out = model(packed.input_ids, packed.position_ids, packed.labels, ctx, temperature=0.7)["logprobs"]
    return (out * weights).sum()


def _grads(model: TokenLogprobModel, mode: str) -> dict[str, torch.Tensor]:
    contexts = {"reference": lambda: torch.autograd.graph.disable_saved_tensors_hooks("reference: autograd's own saving"),
                "offload": lambda: offload_saved_tensors(model, torch.device("cpu"))}
    model.zero_grad(set_to_none=True)
    with contexts.get(mode, contextlib.nullcontext)():
        loss = _forward(model)
    loss.backward()
    return {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone() for n, p in model.named_parameters()}


def _saved_storages(model: TokenLogprobModel) -> tuple[list[int], list[int], list[tuple[int, ...]]]:
    """(storages of the gathered block inputs, storages of the tensors saved for backward, shapes of the
    saved tensors whose last dim is the hidden size) of one forward."""
    gathered: list[torch.Tensor] = []  # kept alive: no later tensor can take their addresses
    hooks = []
    for layer in model.decoder.layers:
        for proj in (layer.self_attn.q_proj, layer.mlp.gate_proj):  # the full input each block's projections read
            hooks.append(proj.register_forward_pre_hook(lambda m, a: gathered.append(a[0].to_local())))
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _forward(model)
    for h in hooks:
        h.remove()
    local = [t._local_tensor if isinstance(t, DTensor) else t for t in saved]
    hidden_shapes = [tuple(t.shape) for t in local if t.dim() >= 2 and t.shape[-1] == HIDDEN]
    return ([t.untyped_storage().data_ptr() for t in gathered], [t.untyped_storage().data_ptr() for t in local],
            hidden_shapes)


def _worker(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    model = _model()
    apply_tensor_parallel(model, mesh["tp"], sequence_parallel=True)
    savers = [b.tp_input_saver for layer in model.decoder.layers for b in (layer.self_attn, layer.mlp)]
    reference = _grads(model, "reference")
    out: dict[str, Any] = {"regathers": {}}
    for mode in ("plain", "offload", "checkpointing"):
        if mode == "checkpointing":
            model.decoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        before = sum(s.regathers for s in savers)
        grads = _grads(model, mode)
        out["regathers"][mode] = sum(s.regathers for s in savers) - before
        out[mode] = [n for n in reference if not torch.equal(grads[n], reference[n])]
    model.decoder.gradient_checkpointing_disable()
    gathered, saved, hidden_shapes = _saved_storages(model)
    out["gathered_saved"] = len(set(gathered) & set(saved))
    out["gathered"] = len(set(gathered))
    out["hidden_shapes"] = hidden_shapes
    out["grads"] = len(reference)
    dist.barrier()
    return out


def test_tp_sp_saves_the_shard_regathers_once_per_block_and_gradients_are_bit_identical() -> None:
    results = run_distributed(_worker, TP)
    blocks = 2 * LAYERS
    tokens = sum(ROWS) + (-sum(ROWS)) % TP
    for rank, res in enumerate(results):
        assert res["grads"] > 10, res
        for mode in ("plain", "offload", "checkpointing"):
            assert res[mode] == [], (rank, mode, res[mode])  # parameters whose gradient differs in any bit
        assert res["gathered"] == blocks and res["gathered_saved"] == 0, (rank, res)
        # the block inputs' shards (and the norms' own [1, S/tp, h] tensors); nothing [.., S, h] at all
        assert sum(s == (1, tokens // TP, HIDDEN) for s in res["hidden_shapes"]) >= blocks, (rank, res)
        assert not [s for s in res["hidden_shapes"] if s[-2] == tokens], (rank, res["hidden_shapes"])
        assert res["regathers"] == {"plain": blocks, "offload": blocks, "checkpointing": blocks}, (rank, res)
