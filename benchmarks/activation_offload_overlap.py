"""Step time and peak memory of activation offload on CUDA: overlapped (side streams, one layer
prefetched) against copies on the compute stream and against no offload.

Model: random-init Qwen2 (hidden 2048, 16 q / 8 kv heads, intermediate 5632, `--layers` layers, vocab
32000), bf16, gradient checkpointing (non-reentrant), one packed row of `--tokens` tokens. Variants:
  none         checkpointing alone (every layer input stays on the device);
The offload contexts wrap the decoder only (the output head's logits are not offloaded).
  compute      `torch.autograd.graph.save_on_cpu(pin_memory=True)`: copies out and back on the compute
               stream, each tensor fetched when backward needs it (rlsp's previous offload);
  overlapped   `rlsp.engine.offload.offload_saved_tensors` (side streams, prefetch one layer ahead).
Each variant: 2 warm-up steps, then the median of `--steps` forward+backward steps; peak allocated
memory during a step. Prints ONE JSON line. Usage: python benchmarks/activation_offload_overlap.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from rlsp.engine.offload import OffloadStats, offload_saved_tensors  # noqa: E402


def _model(layers: int) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=8, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to("cuda", torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _context(variant: str, model: Qwen2ForCausalLM, stats: OffloadStats) -> contextlib.AbstractContextManager:
    if variant == "compute":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    if variant == "overlapped":
        return offload_saved_tensors(model, torch.device("cuda"), stats)
    return contextlib.nullcontext()


def _step(model: Qwen2ForCausalLM, ids: torch.Tensor, variant: str, stats: OffloadStats) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with _context(variant, model, stats):  # the decoder; the head is outside, as rlsp's chunked head keeps little
        hidden = model.model(input_ids=ids).last_hidden_state
    loss = model.lm_head(hidden).float().log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).mean()
    loss.backward()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    model = _model(args.layers)
    ids = torch.randint(0, 32000, (1, args.tokens), device="cuda")
    out: dict = {"device": torch.cuda.get_device_name(), "tokens": args.tokens, "layers": args.layers}
    for variant in ("none", "compute", "overlapped"):
        stats = OffloadStats()
        for _ in range(2):
            _step(model, ids, variant, stats)
        model.zero_grad(set_to_none=True)
        torch.cuda.reset_peak_memory_stats()
        times = [_step(model, ids, variant, stats) for _ in range(args.steps)]
        out[variant] = {"step_s": round(statistics.median(times), 4),
                        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3)}
        if variant == "overlapped":
            out[variant].update(offloaded_bytes=stats.bytes, prefetched_bytes=stats.prefetched_bytes,
                                on_demand_bytes=stats.on_demand_bytes)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
