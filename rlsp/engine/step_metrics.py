"""What one training step of `rlsp.engine.fsdp_engine.FSDPEngine` reports, and its gradient clipping.

Metric contributions of a micro-batch are shares of a global mean: summed over micro-batches and ranks
they give the value; keys ending in "_max" are maxima instead. The sequence-parallel load
(tokens per rank, padding share, all-to-all time share) is averaged over ranks. All reductions are
collective over the default group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlsp.engine.fsdp_offload import to_device


def max_over_ranks(value: float) -> float:
    """The largest `value` any rank holds; collective."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def accumulate_metrics(sums: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor]) -> None:
    """Add a micro-batch's metric shares to `sums` in place (keys ending in "_max": keep the larger)."""
    for key, val in metrics.items():
        val = val.detach().float().cpu()
        if key.endswith("_max"):
            sums[key] = torch.maximum(sums[key], val) if key in sums else val
        else:
            sums[key] = sums.get(key, 0.0) + val


def reduce_metrics(sums: dict[str, torch.Tensor], token_replicas: int) -> dict[str, float]:
    """Sum the shares over all ranks (divided by `token_replicas`, the ranks holding the same output tokens:
    tp without sequence parallelism); keys ending in "_max" are reduced with MAX instead; collective."""
    out: dict[str, float] = {}
    for op, keys in ((dist.ReduceOp.SUM, sorted(k for k in sums if not k.endswith("_max"))),
                     (dist.ReduceOp.MAX, sorted(k for k in sums if k.endswith("_max")))):
        if keys:
            vec = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64) for k in keys])
            dist.all_reduce(vec, op=op)
            out.update(zip(keys, (vec / (token_replicas if op == dist.ReduceOp.SUM else 1)).tolist()))
    return out


def sp_metrics(local: torch.Tensor, world_size: int) -> dict[str, float]:
    """Rank averages of sequence-parallel load from each rank's [local tokens, pad tokens, a2a seconds,
    total seconds]: tokens per rank, padding share, all-to-all time share; collective."""
    dist.all_reduce(local, op=dist.ReduceOp.SUM)
    tokens, pad, a2a_s, total_s = (local / world_size).tolist()
    return {"sp/tokens_per_rank": tokens, "sp/pad_fraction": pad / max(tokens, 1.0),
            "sp/a2a_time_share": a2a_s / max(total_s, 1e-9)}


def clip_grad_norm(module: torch.nn.Module, clip: float, device: torch.device) -> torch.Tensor:
    """Clip `module`'s gradients to total norm `clip` (<= 0: no clipping); returns the norm before clipping
    (a CPU float tensor, non-finite when a gradient is)."""
    params = [p for p in module.parameters() if p.grad is not None]
    # clip_grad_norm_'s two steps, with the norm moved to the device in between: offloaded gradients
    # live in host memory, and the norm's reduction over ranks needs a device tensor (NCCL).
    norm = to_device(torch.nn.utils.get_total_norm([p.grad for p in params]), device)
    torch.nn.utils.clip_grads_with_norm_(params, clip if clip > 0 else float("inf"), norm)
    full = getattr(norm, "full_tensor", None)
    return (full() if full is not None else norm).detach().float().cpu()
