"""The planner's FSDP parameter-offload terms against what rlsp's engine keeps where; prints ONE JSON line.

One rank trains an actor (`FSDPEngine`, fp32 master weights, AdamW, bf16 compute, activation
checkpointing, no reference) for two optimizer steps on one packed micro-batch of `--tokens` tokens (rows
of 512), once with `param_offload=False` and once with `param_offload=True` (FSDP2's CPUOffloadPolicy,
rlsp/engine/fsdp_offload.py). After the second step every parameter shard, gradient and AdamW state
tensor is counted by the device it is on:

* host-resident bytes (the planner's host term per rank, rlsp/plan/offload.py: 12 bytes of state + 4 of
  gradient per parameter; AdamW's foreach temporaries are transient and not counted here) must equal the
  count exactly; on the accelerator the same tensors must come to 0 bytes with offload;
* on CUDA, the step's peak (`torch.cuda.max_memory_allocated` over the second step) against
  `plan_memory(..., param_offload=...)`'s device peak, with and without offload.

On CPU the policy moves nothing (everything already is host memory): the counts still check the host
term, the device columns are absent. Usage:
    python benchmarks/plan_offload.py [--model tiny|qwen2.5-0.5b] [--tokens 8192] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests" / "distributed")]

import plan_memory as pm  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import Qwen2Config  # noqa: E402

from rlsp.config.layout import RoleLayout, World  # noqa: E402
from rlsp.data.batch import Batch  # noqa: E402
from rlsp.engine.fsdp_engine import FSDPEngine  # noqa: E402
from rlsp.engine.optim import OptimSettings  # noqa: E402
from rlsp.models.lm import TokenLogprobModel  # noqa: E402
from rlsp.models.loading import build_causal_lm_from_config  # noqa: E402
from rlsp.parallel.mesh import build_parallel_dims  # noqa: E402
from rlsp.plan import HeadShare, MemoryEstimate, MemoryOptions, Workload, plan_memory, shape_from_config  # noqa: E402
from rlsp.plan.offload import host_bytes_per_rank  # noqa: E402
from rlsp.utils.device import backend_for  # noqa: E402
from rlsp.workers.actor_loss import ActorLossConfig, make_actor_loss  # noqa: E402

MODELS = {"tiny": pm.CONFIG, "qwen2.5-0.5b": {**pm.QWEN05, "head_dim": 64}}
MIB = 2**20


def _tensor_bytes(engine: FSDPEngine) -> dict[str, int]:
    """Bytes of parameter shards, gradients and optimizer state, by the device type they are on."""
    out: dict[str, int] = {}
    tensors = []
    for p in engine.module.parameters():
        tensors += [p, p.grad] if p.grad is not None else [p]
    for state in engine.optimizer.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        out[local.device.type] = out.get(local.device.type, 0) + local.numel() * local.element_size()
    return out


def _watch_phases(engine: FSDPEngine, phases: dict[str, float]) -> None:
    """Record the CUDA peak of each part of a step (forward + backward, clipping, optimizer step) and the bytes
    still allocated after the backward, by wrapping the engine's calls on this instance."""
    def wrap(owner: object, attr: str, label: str) -> None:
        inner = getattr(owner, attr)

        def call(*args: object, **kwargs: object) -> object:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            out = inner(*args, **kwargs)
            torch.cuda.synchronize()
            phases[label] = max(phases.get(label, 0.0), torch.cuda.max_memory_allocated() / MIB)
            phases[f"after {label}"] = torch.cuda.memory_allocated() / MIB
            return out
        setattr(owner, attr, call)
    wrap(engine, "backward_batch", "forward+backward")
    wrap(engine, "_clip_grad", "clip")
    wrap(engine.optimizer, "step", "optimizer step")


def _estimate(name: str, tokens: int, offload: bool) -> tuple[MemoryEstimate, float]:
    """The planner's device estimate for this run, and its host term for the actor's state (bytes)."""
    shape = shape_from_config(MODELS[name])
    w = Workload(RoleLayout(World(1, 1)), tokens, pm.ROW, HeadShare(shape.q_heads, shape.kv_heads))
    opts = MemoryOptions(dtype_bytes=2, checkpointing=True, param_offload=offload)
    host = host_bytes_per_rank(shape, w, opts, critic=False, ref=False).get("actor state", 0.0)
    return plan_memory(shape, w, opts, ref=False), host


def run(name: str, tokens: int, device: torch.device, offload: bool) -> dict[str, object]:
    cfg = {k: v for k, v in MODELS[name].items() if k != "model_type"}
    dims = build_parallel_dims(RoleLayout(World(1, 1)), device.type)
    torch.manual_seed(0)
    with device:
        lm = build_causal_lm_from_config(Qwen2Config(**cfg), dtype=torch.float32)
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine = FSDPEngine(TokenLogprobModel(lm), dims, device, compute_dtype=torch.bfloat16,
                        optim=OptimSettings(lr=1e-4, grad_clip=1.0), param_offload=offload)
    rows = tokens // pm.ROW
    batch = _batch(rows, cfg["vocab_size"])
    loss = make_actor_loss(ActorLossConfig(), float((pm.ROW - pm.PROMPT) * rows))
    peak, phases = None, {}
    base = 0
    if device.type == "cuda":  # what an earlier run left allocated is not this run's
        gc.collect()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated() - _tensor_bytes(engine).get("cuda", 0)
    engine.train_step(batch, pm.PROMPT, rows, loss, tokens, temperature=1.0, with_entropy=True)
    if device.type == "cuda":  # the second step is measured: AdamW state exists, as in every later step
        _watch_phases(engine, phases)
        engine.train_step(batch, pm.PROMPT, rows, loss, tokens, temperature=1.0, with_entropy=True)
        peak = max(phases[k] for k in ("forward+backward", "clip", "optimizer step")) * MIB - base
        phases = {k: v - base / MIB for k, v in phases.items()}
    else:
        engine.train_step(batch, pm.PROMPT, rows, loss, tokens, temperature=1.0, with_entropy=True)
    counted = _tensor_bytes(engine)
    est, host_term = _estimate(name, tokens, offload)
    row: dict[str, object] = {"param_offload": offload, "counted_bytes_by_device": counted,
                              "host_term_bytes": int(host_term),
                              "estimate_device_peak_mib": round(est.peak / MIB, 1)}
    if peak is not None:
        row["measured_device_peak_mib"] = round(peak / MIB, 1)
        row["rel_error"] = round((est.peak - peak) / peak, 3)
        row["measured_phase_mib"] = {k: round(v, 1) for k, v in phases.items()}
        row["estimate_terms_mib"] = {k: round(v / MIB, 1) for k, v in est.terms.items()}
        row["estimate_phase"] = est.phase
    return row


def _batch(rows: int, vocab: int) -> Batch:
    """Rows of 512 random tokens below `vocab` with the fields the actor loss reads."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (rows, pm.ROW), generator=g)
    resp = torch.ones(rows, pm.ROW - pm.PROMPT)
    logps = {k: torch.randn(rows, pm.ROW - pm.PROMPT, generator=g) * 0.3 - 3.0 for k in ("old_logprobs", "ref_logprobs")}
    return Batch.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": resp,
                            "advantages": torch.randn(rows, pm.ROW - pm.PROMPT, generator=g), **logps})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend_for(device.type), store=dist.HashStore(), rank=0, world_size=1)
    runs = [run(a.model, a.tokens, device, off) for off in (True, False)][::-1]
    params = shape_from_config(MODELS[a.model]).params
    on = runs[1]["counted_bytes_by_device"]
    checks = {"host_bytes_equal_term": on.get("cpu", 0) == runs[1]["host_term_bytes"] == 16 * params}
    if device.type == "cuda":
        checks["no_state_on_device_with_offload"] = on.get("cuda", 0) == 0
    print(json.dumps({"benchmark": "plan_offload", "device": device.type, "torch": torch.__version__,
                      "model": a.model, "params": params, "tokens": a.tokens, "runs": runs, "checks": checks}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
