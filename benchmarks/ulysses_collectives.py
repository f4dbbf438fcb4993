"""Count Ulysses all-to-alls and bytes per decoder layer (forward and backward) against the minimum.

Runs a tiny random-init Qwen2 on CPU over gloo at sp=2 and sp=4 (spawned local processes), one
forward+backward on a packed micro-batch, and reads the counters of the SP context. Calls are also
counted independently by wrapping `torch.distributed.all_to_all_single` in the worker processes.
The minimum per layer and direction, summed over ranks, is q + out (T * Hq * D each) plus k and v
for the kv heads each rank's query heads read (T * sum_r kv_r * D each): one exchange in, one out.
Per-rank bytes (forward and backward, bytes leaving the rank) against the closed form, with ring
and Ulysses x ring layouts: benchmarks/sequence_comm.py.
Prints ONE JSON line. Usage: python benchmarks/ulysses_collectives.py
"""

from __future__ import annotations

import dataclasses
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

LAYERS, HEAD_DIM, ROW_LENS = 4, 16, (97, 130, 61, 200)


def _count_wrapper(counter: dict[str, int]) -> Any:
    original = dist.all_to_all_single

    def counted(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counter["calls"] += 1
        counter["bytes"] += input.numel() * input.element_size()
        return original(output, input, *args, **kwargs)

    return counted


def _worker(rank: int, world: int, q_heads: int, kv_heads: int) -> dict[str, Any]:
    counter = {"calls": 0, "bytes": 0}
    dist.all_to_all_single = _count_wrapper(counter)  # this benchmark process only
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=q_heads,
        num_key_value_heads=kv_heads,
        head_dim=HEAD_DIM,
    )
    torch.manual_seed(0)
    model = TokenLogprobModel(build_causal_lm_from_config(config))
    width = max(ROW_LENS)
    ids_BL = torch.randint(1, 64, (len(ROW_LENS), width))
    mask_BL = (torch.arange(width)[None, :] < torch.tensor(ROW_LENS)[:, None]).long()
    packed = pack_sequences(ids_BL, mask_BL, pad_to_multiple=world)
    ctx = build_sp_context(dist.group.WORLD, packed, q_heads, kv_heads)
    lp_S = model(*(shard_for_rank(x, ctx) for x in (packed.input_ids, packed.position_ids, packed.labels)), ctx)["logprobs"]
    (lp_S * shard_for_rank(packed.label_mask, ctx)).sum().backward()
    return {
        "stats": dataclasses.asdict(ctx.stats),
        "wrapped": counter,
        "tokens": packed.total_len,
        "layout": ctx.layout,
    }


def _summarise(q_heads: int, kv_heads: int, sp: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    layout, tokens = results[0]["layout"], results[0]["tokens"]
    elem = 4 * HEAD_DIM * tokens  # fp32 bytes of one head over the whole stream
    fwd = sum(r["stats"]["a2a_bytes_fwd"] for r in results) / LAYERS
    bwd = sum(r["stats"]["a2a_bytes_bwd"] for r in results) / LAYERS
    minimum = elem * (2 * q_heads + 2 * sum(layout.kv_counts))
    return {
        "sp": sp,
        "q_heads": q_heads,
        "kv_heads": kv_heads,
        "tokens": tokens,
        "layers": LAYERS,
        "q_per_rank": list(layout.q_counts),
        "kv_per_rank": list(layout.kv_counts),
        "a2a_per_layer_fwd": [r["stats"]["a2a_calls_fwd"] / LAYERS for r in results],
        "a2a_per_layer_bwd": [r["stats"]["a2a_calls_bwd"] / LAYERS for r in results],
        "wrapped_calls_match": all(
            r["wrapped"]["calls"] == r["stats"]["a2a_calls_fwd"] + r["stats"]["a2a_calls_bwd"] for r in results
        ),
        "bytes_per_layer_fwd_all_ranks": fwd,
        "bytes_per_layer_bwd_all_ranks": bwd,
        "min_bytes_per_layer_all_ranks": minimum,
        "ratio_to_min_fwd": fwd / minimum,
        "ratio_to_min_bwd": bwd / minimum,
        # for comparison: no kv replication at all, and kv expanded to every q head before the exchange
        "bytes_if_no_kv_replication": elem * (2 * q_heads + 2 * kv_heads),
        "bytes_if_kv_expanded_to_q": elem * 4 * q_heads,
        "off_rank_fraction": (sp - 1) / sp,
        "kv_replication": layout.kv_replication(),
        "load_imbalance": layout.load_imbalance(),
        "a2a_seconds_max_rank": max(r["stats"]["a2a_seconds"] for r in results),
    }


def main() -> None:
    runs = []
    for q_heads, kv_heads in ((8, 4), (6, 2)):
        for sp in (2, 4):
            runs.append(_summarise(q_heads, kv_heads, sp, run_distributed(_worker, sp, q_heads, kv_heads)))
    print(json.dumps({"benchmark": "ulysses_collectives", "device": "cpu", "backend": "gloo", "runs": runs}))


if __name__ == "__main__":
    main()
