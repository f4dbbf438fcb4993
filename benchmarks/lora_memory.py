"""Per-rank training memory of the actor with and without LoRA: weights, gradients, AdamW state.

Runs the policy engine as the actor builds it (FSDP2 over `--world` gloo ranks, dp = world) on a
real model (default SmolLM2-135M-Instruct from the rlsp cache), full fine-tuning and LoRA at rank
`--rank` on all linear layers, and one optimizer step on a random rollout-shaped batch. Measured on
rank 0 (this rank's local shards): bytes of trainable and frozen parameters, of gradients after the
backward, and of AdamW state after the step, and the step's wall time. Also printed: the same
numbers in closed form from parameter counts (fp32 masters, bf16 frozen base for the GPU setting).
Prints ONE JSON line. Usage:
  python benchmarks/lora_memory.py [--model DIR] [--world 2] [--rank 32] [--alpha 32]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from rlsp.config.layout import RoleLayout, World  # noqa: E402
from rlsp.data.batch import Batch  # noqa: E402
from rlsp.engine.fsdp_engine import FSDPEngine  # noqa: E402
from rlsp.engine.optim import OptimSettings  # noqa: E402
from rlsp.models.lm import TokenLogprobModel  # noqa: E402
from rlsp.models.loading import load_causal_lm  # noqa: E402
from rlsp.models.lora import LoraSettings, apply_lora  # noqa: E402
from rlsp.parallel.mesh import build_parallel_dims  # noqa: E402
from rlsp.workers.actor_loss import ActorLossConfig, make_actor_loss  # noqa: E402

MIB = 2**20
P, R, B = 64, 48, 16


def _batch(vocab: int) -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (B, P + R), generator=g)
    mask = torch.ones(B, P + R, dtype=torch.long)
    resp = torch.ones(B, R)
    fields = {k: torch.randn(B, R, generator=g) * 0.3 - 3.0 for k in ("old_logprobs", "ref_logprobs")}
    return Batch.from_dict({"input_ids": ids, "attention_mask": mask, "response_mask": resp,
                            "advantages": torch.randn(B, R, generator=g), **fields})


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _measure(model: str, lora: LoraSettings | None, world: int) -> dict[str, float]:
    dims = build_parallel_dims(RoleLayout(World(1, world)), "cpu")
    lm = load_causal_lm(model, dtype=torch.float32)
    if lora is not None:
        apply_lora(lm, lora)
    engine = FSDPEngine(TokenLogprobModel(lm), dims, torch.device("cpu"), optim=OptimSettings(lr=1e-5))
    params = list(engine.module.parameters())
    shard = _batch(lm.config.vocab_size).chunk(dims.dp_size)[dims.dp_rank]
    loss_fn = make_actor_loss(ActorLossConfig(use_kl_loss=lora is not None), float(B * R))
    t0 = time.perf_counter()
    engine.optimizer.zero_grad(set_to_none=True)
    engine.backward_batch(shard, P, B, loss_fn, temperature=1.0)
    grads = _local_bytes(p.grad for p in params if p.grad is not None)
    engine.optimizer.step()
    step_s = time.perf_counter() - t0
    state = [v for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"trainable_params_mib": _local_bytes(p for p in params if p.requires_grad) / MIB,
            "frozen_params_mib": _local_bytes(p for p in params if not p.requires_grad) / MIB,
            "grads_mib": grads / MIB, "adam_state_mib": _local_bytes(state) / MIB,
            "trainable_numel": sum(p.numel() for p in lm.parameters() if p.requires_grad),
            "total_numel": sum(p.numel() for p in lm.parameters()), "step_s": step_s}


def _worker(rank: int, world: int, init: str, out: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    lora = LoraSettings(rank=args.rank, alpha=args.alpha)
    result = {"full": _measure(args.model, None, world), "lora": _measure(args.model, lora, world)}
    if rank == 0:
        torch.save(result, out)
    dist.destroy_process_group()


def _closed_form(full_numel: int, adapter_numel: int, world: int) -> dict[str, dict[str, float]]:
    """Bytes per rank (FSDP2 shards everything over the world): fp32 masters, fp32 gradients, two
    fp32 AdamW moments; LoRA's frozen base in fp32 (CPU) or bf16 (GPU compute dtype)."""
    def mib(n: float) -> float:
        return n / world / MIB
    full = {"weights": mib(4 * full_numel), "grads": mib(4 * full_numel), "adam": mib(8 * full_numel)}
    out = {"full": {**full, "total": sum(full.values())}}
    for name, base_bytes in (("lora_fp32_base", 4), ("lora_bf16_base", 2)):
        parts = {"weights": mib(base_bytes * full_numel + 4 * adapter_numel), "grads": mib(4 * adapter_numel),
                 "adam": mib(8 * adapter_numel)}
        out[name] = {**parts, "total": sum(parts.values())}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="HF directory (default: the cached SmolLM2-135M-Instruct)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--alpha", type=float, default=32.0)
    args = ap.parse_args()
    if args.model is None:
        from rlsp.models.fetch import fetch_model  # noqa: PLC0415

        args.model = fetch_model("smollm2-135m-instruct")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.start_processes(_worker, args=(args.world, os.path.join(tmp, "init"), out, args), nprocs=args.world,
                           start_method="spawn")
        result = torch.load(out, weights_only=False)
    full_n = result["full"]["total_numel"]
    adapter_n = result["lora"]["trainable_numel"]
    print(json.dumps({"model": args.model, "world": args.world, "lora_rank": args.rank, "measured_rank0": result,
                      "closed_form_mib_per_rank": _closed_form(full_n, adapter_n, args.world)}))


if __name__ == "__main__":
    main()
