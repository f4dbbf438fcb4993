"""One generate call of the hf rollout engine with its lean decoding forward against the model's own forward.

The same engine, the same prompts and the same sampling seed; the two decoders alternate round by round
(`engine.lean` set or None) and the medians are reported. Every row decodes exactly --max-tokens tokens
(stop tokens cleared), so both do the same work. Accuracy: each decoder's logprobs of the tokens it
sampled against one full forward of every row's prompt + response in the same dtype (what the trainer
recomputes); the lean forward passes when its gap is no larger than the model's own decoder's
(x 1.5 + one ulp of the dtype at the logprobs' scale, the rule of tests/unit/test_lean_decoder.py).

    python benchmarks/hf_decode.py --device cpu --shape tiny            # the built-in tiny model
    python benchmarks/hf_decode.py --device cuda --shape qwen2.5-0.5b --dtype bfloat16

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rlsp.models.tiny import TinyModelSpec, build_tiny_model  # noqa: E402
from rlsp.rollout.base import SamplingConfig  # noqa: E402
from rlsp.rollout.hf_engine import HFEngine  # noqa: E402

SHAPES = {
    "tiny": TinyModelSpec(),
    "qwen2.5-0.5b": TinyModelSpec(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                  num_key_value_heads=2, max_position_embeddings=4096, vocab_size=151936),
}
ULP = {"float32": 2.0**-23, "bfloat16": 2.0**-8, "float64": 2.0**-52}


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--dtype", choices=sorted(ULP), default="float32")
    p.add_argument("--samples", type=int, default=64, help="rows of the call")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=10, help="timed calls per decoder, alternating")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads on CPU (0: torch's default)")
    return p.parse_args()


def _prompts(samples: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 33, (samples,), generator=gen).tolist()
    return [torch.randint(10, min(vocab, 60), (n,), generator=gen).tolist() for n in lengths]


def _timed(engine: HFEngine, prompts: list[list[int]], sampling: SamplingConfig, cuda: bool):
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = engine.generate(prompts, sampling)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def _gap_to_full_forward(engine: HFEngine, prompts: list[list[int]], out) -> float:
    """Max |decoder logprob - full-forward logprob (the engine's `prompt_logprobs`)| over every sampled token."""
    return max(abs(full - got)
               for prompt, ids, lps in zip(prompts, out.response_ids, out.response_logprobs)
               for full, got in zip(engine.prompt_logprobs(prompt + ids)[len(prompt):], lps))


def main() -> None:
    a = _args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cuda = torch.device(a.device).type == "cuda"
    spec = SHAPES[a.shape]
    with tempfile.TemporaryDirectory() as tmp:
        engine = HFEngine(build_tiny_model(spec, tmp), dtype=a.dtype, device=a.device)
    lean = engine.lean
    if lean is None:
        raise SystemExit("hf_decode: the lean decoder does not cover this model")
    engine.stop_ids = set()  # every row decodes --max-tokens tokens
    prompts = _prompts(a.samples, engine.model.config.vocab_size)
    sampling = SamplingConfig(n=1, temperature=1.0, max_tokens=a.max_tokens, seed=7)
    times: dict[str, list[float]] = {"lean": [], "own": []}
    outs = {}
    for r in range(a.rounds + 1):  # round 0 warms both up
        for name in ("lean", "own") if r % 2 == 0 else ("own", "lean"):
            engine.lean = lean if name == "lean" else None
            seconds, outs[name] = _timed(engine, prompts, sampling, cuda)
            if r:
                times[name].append(seconds)
    gaps = {name: _gap_to_full_forward(engine, prompts, outs[name]) for name in outs}
    scale = max(abs(x) for row in outs["own"].response_logprobs for x in row)
    ok = gaps["lean"] <= 1.5 * gaps["own"] + scale * ULP[a.dtype]
    lean_s, own_s = statistics.median(times["lean"]), statistics.median(times["own"])
    tokens = a.samples * a.max_tokens
    print(json.dumps({
        "benchmark": "hf_decode", "device": torch.cuda.get_device_name(0) if cuda else "cpu", "shape": a.shape,
        "params": sum(p.numel() for p in engine.model.parameters()), "dtype": a.dtype, "samples": a.samples,
        "max_tokens": a.max_tokens, "rounds": a.rounds, "threads": torch.get_num_threads(),
        "lean_s": round(lean_s, 4), "own_s": round(own_s, 4), "speedup": round(own_s / lean_s, 3),
        "lean_tokens_per_s": round(tokens / lean_s, 1), "own_tokens_per_s": round(tokens / own_s, 1),
        "same_tokens": outs["lean"].response_ids == outs["own"].response_ids,
        "logprob_gap_lean": gaps["lean"], "logprob_gap_own": gaps["own"], "ok": ok,
    }))


if __name__ == "__main__":
    main()
