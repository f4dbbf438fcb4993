"""Bytes saved for backward per rank for one packed micro-batch, sequence-parallel over k shards (CPU, gloo).

Layouts (ulysses x ring = k): 1 x 1, Ulysses 2 and 4, ring 2 and 4, Ulysses 2 x ring 2; groups from
the role layout (`RoleLayout(World(1, k), ulysses=, ring=)`), as in training.

Model: random-init Qwen2, hidden 256, 8 q / 4 kv heads (head dim 32), 4 layers, vocab 1024. Batch:
a 4096-token packed stream of 11 sequences of uneven lengths. Every tensor autograd saves during
the forward is recorded with `torch.autograd.graph.saved_tensors_hooks`; bytes are counted once per
distinct storage and parameters are excluded, so the number is the activation memory held for
backward. The vocab-chunked logprob head keeps only its inputs (checkpointed chunks), which the
hook does not see; they are the final hidden states, already counted as the final norm's output.
Ring attention saves only its local q, k, v, out and lse [hq, Tr] per layer (no score blocks); its
per-micro-batch plan additionally caches one bool mask per ring step, shared by all layers and not a
saved tensor: reported apart as `ring_mask_bytes` (at most T * Tr bytes).
Target: ratio to k=1 <= 1.05 / k. Prints ONE JSON line. Usage: python benchmarks/activation_memory.py
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
from transformers import Qwen2Config  # noqa: E402

from rlsp.data.packing import pack_sequences  # noqa: E402
from rlsp.models.lm import TokenLogprobModel  # noqa: E402
from rlsp.models.loading import build_causal_lm_from_config  # noqa: E402
from rlsp.parallel.ulysses import build_sp_context, shard_for_rank  # noqa: E402

ROW_LENS = (700, 300, 512, 96, 431, 257, 1000, 64, 333, 190, 213)  # sum 4096
Q_HEADS, KV_HEADS = 8, 4
LAYOUTS = ((1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (2, 2))  # (ulysses, ring)


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


def _measure(rank: int, world: int, ulysses: int, ring: int) -> dict[str, Any]:
    dims = layout_dims(ulysses=ulysses, ring=ring)
    model = _model()
    width = max(ROW_LENS)
    ids_BL = torch.randint(1, 1024, (len(ROW_LENS), width), generator=torch.Generator().manual_seed(0))
    mask_BL = (torch.arange(width)[None, :] < torch.tensor(ROW_LENS)[:, None]).long()
    packed = pack_sequences(ids_BL, mask_BL, pad_to_multiple=dims.layout.stream_multiple)
    ctx = build_sp_context(dims.ulysses_group, packed, Q_HEADS, KV_HEADS, ring_group=dims.ring_group)
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages and storage.nbytes() > 0:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp_S = model(*(shard_for_rank(x, ctx) for x in (packed.input_ids, packed.position_ids, packed.labels)), ctx)["logprobs"]
    masks = [b for blocks in (ctx.ring.cache.values() if ctx.ring else ()) for b in blocks if b is not None]
    (lp_S * shard_for_rank(packed.label_mask, ctx)).sum().backward()  # the graph is valid end to end
    return {"saved_bytes": sum(saved.values()), "tokens": packed.total_len, "local_tokens": ctx.local_len,
            "ring_mask_bytes": sum(b.mask_QK.numel() * b.mask_QK.element_size() for b in masks)}


def main() -> None:
    runs: list[dict[str, Any]] = []
    base = None
    for ulysses, ring in LAYOUTS:
        k = ulysses * ring
        results = run_distributed(_measure, k, ulysses, ring)
        per_rank = [r["saved_bytes"] for r in results]
        base = base or max(per_rank)
        runs.append(
            {
                "ulysses": ulysses,
                "ring": ring,
                "shards": k,
                "tokens": results[0]["tokens"],
                "local_tokens": results[0]["local_tokens"],
                "saved_bytes_per_rank": per_rank,
                "max_saved_mib": max(per_rank) / 2**20,
                "ratio_vs_k1": max(per_rank) / base,
                "target_ratio": 1.05 / k,
                "meets_target": max(per_rank) / base <= 1.05 / k,
                "ring_mask_mib_max_rank": max(r["ring_mask_bytes"] for r in results) / 2**20,
            }
        )
    print(
        json.dumps(
            {"benchmark": "activation_memory", "device": "cpu", "torch": torch.__version__,
             "model": "qwen2 h256 8q/4kv L4 V1024", "runs": runs}
        )
    )


if __name__ == "__main__":
    main()
