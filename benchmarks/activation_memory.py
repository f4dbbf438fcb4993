"""Bytes saved for backward per rank for one packed micro-batch, sequence-parallel over k shards or tensor
parallel (CPU, gloo).

Layouts (ulysses x ring x tp): 1 x 1 x 1, Ulysses 2 and 4, ring 2 and 4, Ulysses 2 x ring 2, tensor
parallelism (TP) 2 with and without sequence-parallel activations, and Ulysses 2 x TP 2 (sequence
parallel); groups from the role layout (`RoleLayout(World(1, u*r*t), ulysses=, ring=, tp=)`), as in
training; TP is `apply_tensor_parallel` on the tp mesh (no FSDP: it changes no activation).

Model: random-init Qwen2, hidden 256, 8 q / 4 kv heads (head dim 32), 4 layers, vocab 1024. Batch:
a 4096-token packed stream of 11 sequences of uneven lengths. Every tensor autograd saves during
the forward is recorded with `torch.autograd.graph.saved_tensors_hooks` (a DTensor by its local
tensor); bytes are counted once per distinct storage and parameters are excluded, so the number is
the activation memory held for backward. The vocab-chunked logprob head keeps only its inputs
(checkpointed chunks), which the hook does not see; they are the final hidden states, already
counted as the final norm's output. Ring attention saves only its local q, k, v, out and lse [hq, Tr]
per layer (no score blocks); its per-micro-batch plan additionally caches one bool mask per ring
step, shared by all layers and not a saved tensor: reported apart as `ring_mask_bytes` (at most
T * Tr bytes).

Each saved storage is attributed to the module that saved it first (forward hooks), in five regions:
  block_inputs  the inputs the q/k/v and gate/up projections save: the normed residual [S, h], twice
                per layer; under TP without sequence parallelism the full [S] tokens of the tp group
                on every tp rank, with it only the rank's [S/tp] shard (the block's all-gathered input
                is re-gathered in backward, rlsp.parallel.tp_sp);
  attention     the rest of self_attn: rotary q/k, attention (Ulysses / ring), the o_proj input;
  mlp           the rest of the MLP: gate/up outputs, activation, the down_proj input;
  norms         the RMSNorms (two per layer and the final one);
  other         the embedding's token ids, the decoder's glue and the logprob head.
Target: ratio to one rank <= 1.05 / k, k the world size. Prints ONE JSON line.
Usage: python benchmarks/activation_memory.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "distributed")]

import torch  # noqa: E402
from _launch import layout_dims, run_distributed  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import Qwen2Config  # noqa: E402

from rlsp.data.packing import pack_sequences  # noqa: E402
from rlsp.models.lm import TokenLogprobModel  # noqa: E402
from rlsp.models.loading import build_causal_lm_from_config  # noqa: E402
from rlsp.parallel.tensor_parallel import apply_tensor_parallel  # noqa: E402
from rlsp.parallel.tp_checks import local_head_counts  # noqa: E402
from rlsp.parallel.ulysses import build_sp_context, shard_for_rank  # noqa: E402

ROW_LENS = (700, 300, 512, 96, 431, 257, 1000, 64, 333, 190, 213)  # sum 4096
Q_HEADS, KV_HEADS = 8, 4
LAYOUTS = ((1, 1, 1, True), (2, 1, 1, True), (4, 1, 1, True), (1, 2, 1, True), (1, 4, 1, True), (2, 2, 1, True),
           (1, 1, 2, True), (1, 1, 2, False), (2, 1, 2, True))  # (ulysses, ring, tp, sequence_parallel)
REGIONS = ("block_inputs", "attention", "mlp", "norms", "other")


def _model() -> TokenLogprobModel:
    config = Qwen2Config(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=Q_HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=32,
    )
    torch.manual_seed(0)
    return TokenLogprobModel(build_causal_lm_from_config(config))


def _track_regions(model: TokenLogprobModel) -> list[str]:
    """A stack whose top is the region of the module running now (hooks run before TP's own)."""
    stack = ["other"]
    decoder = model.decoder
    regions: list[tuple[nn.Module, str]] = [(decoder.norm, "norms")]
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        regions += [(layer.input_layernorm, "norms"), (layer.post_attention_layernorm, "norms"),
                    (attn, "attention"), (mlp, "mlp")]
        regions += [(m, "block_inputs") for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)]

    def leave(*_: Any) -> None:  # a forward hook's return value would replace the output
        stack.pop()

    for module, region in regions:
        module.register_forward_pre_hook(lambda *_, r=region: stack.append(r), prepend=True)
        module.register_forward_hook(leave, prepend=True)
    return stack


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    if isinstance(t, DTensor):
        with torch.no_grad():
            t = t.to_local()
    return t.untyped_storage()


def _measure(rank: int, world: int, ulysses: int, ring: int, tp: int, seq_par: bool) -> dict[str, Any]:
    dims = layout_dims(ulysses=ulysses, ring=ring, tp=tp, sequence_parallel=seq_par)
    model = _model()
    if tp > 1:
        apply_tensor_parallel(model, dims.tp_mesh, seq_par)
    stack = _track_regions(model)
    width = max(ROW_LENS)
    ids_BL = torch.randint(1, 1024, (len(ROW_LENS), width), generator=torch.Generator().manual_seed(0))
    mask_BL = (torch.arange(width)[None, :] < torch.tensor(ROW_LENS)[:, None]).long()
    packed = pack_sequences(ids_BL, mask_BL, pad_to_multiple=dims.layout.stream_multiple)
    hq, hkv = local_head_counts(model.decoder.config, tp)
    ctx = build_sp_context(dims.ulysses_group, packed, hq, hkv, ring_group=dims.ring_group,
                           ring_dkv_group=dims.ring_dkv_group)
    param_storages = {_storage(p).data_ptr() for p in model.parameters()}
    saved: dict[int, tuple[str, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = _storage(t)
        if storage.data_ptr() not in param_storages and storage.nbytes() > 0 and storage.data_ptr() not in saved:
            saved[storage.data_ptr()] = (stack[-1], storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp_S = model(*(shard_for_rank(x, ctx) for x in (packed.input_ids, packed.position_ids, packed.labels)), ctx)["logprobs"]
    masks = [b for steps in (ctx.ring.cache.values() if ctx.ring else ()) for blocks in steps for b in blocks]
    weights = shard_for_rank(packed.label_mask, ctx)
    weights = model.tp_info.local_tokens(weights) if tp > 1 else weights
    (lp_S * weights).sum().backward()  # the graph is valid end to end
    regions = {r: sum(n for region, n in saved.values() if region == r) for r in REGIONS}
    return {"saved_bytes": sum(regions.values()), "regions": regions, "tokens": packed.total_len,
            "local_tokens": lp_S.shape[0], "stack_balanced": stack == ["other"],
            "ring_mask_bytes": sum(b.nbytes for b in masks)}


def _run(ulysses: int, ring: int, tp: int, seq_par: bool, base: dict[str, Any] | None) -> dict[str, Any]:
    k = ulysses * ring * tp
    results = run_distributed(_measure, k, ulysses, ring, tp, seq_par)
    assert all(r["stack_balanced"] for r in results), "region hooks unbalanced"
    per_rank = [r["saved_bytes"] for r in results]
    worst = max(results, key=lambda r: r["saved_bytes"])
    base = base or worst
    return {
        "ulysses": ulysses, "ring": ring, "tp": tp, "sequence_parallel": seq_par if tp > 1 else None, "shards": k,
        "tokens": results[0]["tokens"], "local_tokens": results[0]["local_tokens"],  # tokens of the head outputs
        "saved_bytes_per_rank": per_rank,
        "max_saved_mib": max(per_rank) / 2**20,
        "ratio_vs_k1": max(per_rank) / base["saved_bytes"],
        "target_ratio": 1.05 / k,
        "meets_target": max(per_rank) / base["saved_bytes"] <= 1.05 / k,
        # the rank with the most saved bytes, per region, and that region's ratio to one rank
        "regions_mib": {r: v / 2**20 for r, v in worst["regions"].items()},
        "region_ratio_vs_k1": {r: v / base["regions"][r] for r, v in worst["regions"].items()},
        "ring_mask_mib_max_rank": max(r["ring_mask_bytes"] for r in results) / 2**20,
    }, base


def main() -> None:
    runs: list[dict[str, Any]] = []
    base = None
    for ulysses, ring, tp, seq_par in LAYOUTS:
        run, base = _run(ulysses, ring, tp, seq_par, base)
        runs.append(run)
    print(
        json.dumps(
            {"benchmark": "activation_memory", "device": "cpu", "torch": torch.__version__,
             "model": "qwen2 h256 8q/4kv L4 V1024", "runs": runs}
        )
    )


if __name__ == "__main__":
    main()
