"""Bytes saved for backward per rank at sp=1, 2, 4 for one packed micro-batch (Ulysses SP, CPU, gloo).

Model: random-init Qwen2, hidden 256, 8 q / 4 kv heads (head dim 32), 4 layers, vocab 1024. Batch:
a 4096-token packed stream of 11 sequences of uneven lengths. Every tensor autograd saves during
the forward is recorded with `torch.autograd.graph.saved_tensors_hooks`; bytes are counted once per
distinct storage and parameters are excluded, so the number is the activation memory held for
backward. The vocab-chunked logprob head keeps only its inputs (checkpointed chunks), which the
hook does not see; they are the final hidden states, already counted as the final norm's output.
Target: ratio to sp=1 <= 1.05 / sp. Prints ONE JSON line. Usage: python benchmarks/activation_memory.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "distributed")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _launch import run_distributed  # noqa: E402
from transformers import Qwen2Config  # noqa: E402

from rlsp.data.packing import pack_sequences  # noqa: E402
from rlsp.models.lm import TokenLogprobModel  # noqa: E402
from rlsp.models.loading import build_causal_lm_from_config  # noqa: E402
from rlsp.parallel.ulysses import build_sp_context, shard_for_rank  # noqa: E402

ROW_LENS = (700, 300, 512, 96, 431, 257, 1000, 64, 333, 190, 213)  # sum 4096
Q_HEADS, KV_HEADS = 8, 4


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


def _measure(rank: int, world: int) -> dict[str, Any]:
    model = _model()
    width = max(ROW_LENS)
    ids_BL = torch.randint(1, 1024, (len(ROW_LENS), width), generator=torch.Generator().manual_seed(0))
    mask_BL = (torch.arange(width)[None, :] < torch.tensor(ROW_LENS)[:, None]).long()
    packed = pack_sequences(ids_BL, mask_BL, pad_to_multiple=world)
    group = dist.group.WORLD if world > 1 else None
    ctx = build_sp_context(group, packed, Q_HEADS, KV_HEADS)
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages and storage.nbytes() > 0:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp_S = model(*(shard_for_rank(x, ctx) for x in (packed.input_ids, packed.position_ids, packed.labels)), ctx)["logprobs"]
    (lp_S * shard_for_rank(packed.label_mask, ctx)).sum().backward()  # the graph is valid end to end
    return {"saved_bytes": sum(saved.values()), "tokens": packed.total_len, "local_tokens": ctx.local_len}


def _measure_sp1(rank: int, world: int) -> dict[str, Any]:
    return _measure(rank, 1)


def main() -> None:
    runs: list[dict[str, Any]] = []
    base = None
    for sp in (1, 2, 4):
        results = run_distributed(_measure if sp > 1 else _measure_sp1, sp)
        per_rank = [r["saved_bytes"] for r in results]
        base = base or max(per_rank)
        runs.append(
            {
                "sp": sp,
                "tokens": results[0]["tokens"],
                "local_tokens": results[0]["local_tokens"],
                "saved_bytes_per_rank": per_rank,
                "max_saved_mib": max(per_rank) / 2**20,
                "ratio_vs_sp1": max(per_rank) / base,
                "target_ratio": 1.05 / sp,
                "meets_target": max(per_rank) / base <= 1.05 / sp,
            }
        )
    print(
        json.dumps(
            {"benchmark": "activation_memory", "device": "cpu", "model": "qwen2 h256 8q/4kv L4 V1024", "runs": runs}
        )
    )


if __name__ == "__main__":
    main()
