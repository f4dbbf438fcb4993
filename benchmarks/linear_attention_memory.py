"""Peak memory per rank of one long sequence through a hybrid linear-attention model, forward + backward, at
Ulysses 1 / 2 / 4 (CPU, gloo, one process per rank).

Model: Qwen3.5 (text) random init with the widths of Qwen3-Next's Gated DeltaNet layer (hidden 2048, 16 linear key
heads / 32 value heads of dim 128, conv 4) by default; `--hidden`, `--key-heads`, `--value-heads` and `--head-dim`
narrow it (for sequences whose Qwen3-Next-width run does not fit the machine; keep value heads = 2 x key heads as in
Qwen3-Next; `--head-dim` is the linear key and value head dim and the full-attention head dim). `--layers` picks the
layer types (default one linear_attention layer: the layer whose memory matters here; add full_attention for the
hybrid pair, 16 query / 2 kv heads, whose CPU cost is quadratic in the tokens). The MLP is narrow (512) and the
vocabulary small (1024): neither is what is measured.
Each rank runs rlsp's packed, Ulysses-aware Gated DeltaNet (rlsp.models.linear_attention: key-head groups split
over the Ulysses ranks, conv and recurrent state per packed row) on its 1/u of the tokens and takes the logprobs'
sum backward.

Measured per rank: peak resident set size (getrusage ru_maxrss: the process's high-water mark, the Python and torch
runtime, the weights and their gradients included) and the same after building the model and the batch
(`rss_before_mib`): `peak_delta_mib` = peak - before is what the forward + backward of the sequence added.

CPU time: transformers' reference chunked delta rule (the CPU kernel) loops over 64-token chunks and indexes one chunk
of its whole-segment tensors per step, so its backward builds a full-size gradient per chunk: quadratic in the
segment's tokens (at hidden 128, 4 / 8 heads of dim 32 and Ulysses 1: 4096 / 8192 / 16384 tokens 2.2 / 9.9 / 37 s).
On a shared machine give each rank one thread (`--threads` is split over the ranks): two OpenMP threads on
oversubscribed cores took 41 s instead of 2.2 s for 4096 tokens.

Prints one JSON line:
    .venv/bin/python benchmarks/linear_attention_memory.py --tokens 8192 --ulysses 1 2 4
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "distributed")]

import torch  # noqa: E402
from _launch import layout_dims, run_distributed  # noqa: E402
from transformers import Qwen3_5TextConfig  # noqa: E402

from rlsp.data.packing import pack_sequences  # noqa: E402
from rlsp.models.lm import TokenLogprobModel  # noqa: E402
from rlsp.models.loading import build_causal_lm_from_config  # noqa: E402
from rlsp.parallel.ulysses import build_sp_context, shard_for_rank  # noqa: E402

VOCAB = 1024


def _config(args: argparse.Namespace) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=512, num_hidden_layers=len(args.layers),
        layer_types=list(args.layers), num_attention_heads=16, num_key_value_heads=2, head_dim=args.head_dim,
        linear_num_key_heads=args.key_heads, linear_num_value_heads=args.value_heads, linear_key_head_dim=args.head_dim,
        linear_value_head_dim=args.head_dim, linear_conv_kernel_dim=4)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _measure(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(max(1, args.threads // world))
    dims = layout_dims(ulysses=world)
    torch.manual_seed(0)
    config = _config(args)
    model = TokenLogprobModel(build_causal_lm_from_config(config))
    ids_BL = torch.randint(1, VOCAB, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    packed = pack_sequences(ids_BL, torch.ones_like(ids_BL), pad_to_multiple=dims.layout.stream_multiple)
    ctx = build_sp_context(dims.ulysses_group, packed, config.num_attention_heads, config.num_key_value_heads)
    inputs = [shard_for_rank(x, ctx) for x in (packed.input_ids, packed.position_ids, packed.labels)]
    before = _rss_mib()
    t0 = time.perf_counter()
    lp_S = model(*inputs, ctx)["logprobs"]
    lp_S.sum().backward()
    seconds = time.perf_counter() - t0
    peak = _rss_mib()
    return {"rss_before_mib": round(before), "rss_peak_mib": round(peak), "peak_delta_mib": round(peak - before),
            "seconds": round(seconds, 1), "local_tokens": lp_S.shape[0]}


LAYER_TYPES = ("linear_attention", "full_attention")


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return number


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; refuses widths the model cannot be built with, naming the option, its value and the rule."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=_positive, default=65536)
    parser.add_argument("--ulysses", type=_positive, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", nargs="+", choices=LAYER_TYPES, default=["linear_attention"])
    parser.add_argument("--hidden", type=_positive, default=2048)
    parser.add_argument("--key-heads", type=_positive, default=16)
    parser.add_argument("--value-heads", type=_positive, default=32)
    parser.add_argument("--head-dim", type=_positive, default=128,
                        help="linear key / value and full-attention head dim")
    parser.add_argument("--threads", type=_positive, default=torch.get_num_threads(), help="split over the ranks")
    args = parser.parse_args(argv)
    if args.value_heads % args.key_heads:
        parser.error(f"--value-heads {args.value_heads} must be a multiple of --key-heads {args.key_heads} "
                     "(each value head reads key head j // (value heads / key heads))")
    return args


def summarise(u: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    """One Ulysses degree: the ranks' results, their maxima, and the peak delta per local token (KiB)."""
    delta, local = max(r["peak_delta_mib"] for r in results), max(r["local_tokens"] for r in results)
    return {"ulysses": u, "per_rank": results, "max_peak_delta_mib": delta,
            "max_rss_peak_mib": max(r["rss_peak_mib"] for r in results),
            "delta_kib_per_local_token": round(delta * 1024 / local, 1),
            "max_seconds": max(r["seconds"] for r in results)}


def main() -> None:
    args = parse_args()
    runs = [summarise(u, run_distributed(_measure, u, args, timeout_s=3600)) for u in args.ulysses]
    base = runs[0]["max_peak_delta_mib"]
    for run in runs:
        run["delta_ratio_vs_first"] = round(run["max_peak_delta_mib"] / max(base, 1), 3)
    print(json.dumps({"benchmark": "linear_attention_memory", "device": "cpu", "torch": torch.__version__,
                      "tokens": args.tokens, "layers": args.layers, "hidden": args.hidden,
                      "linear_heads": [args.key_heads, args.value_heads], "head_dims": [args.head_dim, args.head_dim],
                      "threads": args.threads, "measure": "getrusage ru_maxrss per rank process", "runs": runs}))


if __name__ == "__main__":
    main()
