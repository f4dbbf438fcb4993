"""Apply FSDP2 to a head model: each decoder layer and the root are sharded over the role's FSDP mesh
(every rank but the tensor-parallel dimension, or HSDP groups of `fsdp_size` of them; see ParallelDims).

Master weights stay in their load dtype (fp32 for trainable models); `MixedPrecisionPolicy` casts
them to the compute dtype when FSDP all-gathers them for a forward, and gradients are reduced in
fp32. An offload policy (rlsp.engine.fsdp_offload) keeps the shards, gradients and hence the
optimizer state in host memory. Gradient reduction SUMS over ranks (FSDP's division turned off):
each rank's loss is already its share of the global token-mean, so the reduced gradient is exact for
any dp x sp x micro-batching.

With expert parallelism each MoE layer's experts module (already sliced to this rank's experts) is sharded
first, over the ranks holding the same experts, so the layer's own FSDP unit leaves it out and its gradients
are summed over exactly those ranks.

A whole model on every rank (`fsdp_size=1`, no tensor parallelism, no offload) that computes in its
own dtype has nothing for FSDP to do but add per-layer hooks, copies and one all-reduce per layer and
micro-batch: it stays a plain module (`replicated`), and the engine sums its gradients itself, once per
optimizer step, in one flat all-reduce (`all_reduce_gradients`; the same sums, hence the same step).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from rlsp.parallel.mesh import ParallelDims


def replicated(module: nn.Module, dims: ParallelDims, compute_dtype: torch.dtype,
               offload: OffloadPolicy | None = None) -> bool:
    """True when `module` needs no FSDP: one whole copy per rank (tp 1, shard size 1, no expert parallelism),
    no parameter offload, every parameter already in the compute dtype (no mixed-precision casts to make)."""
    layout = dims.layout
    return (layout.tp == 1 and layout.ep == 1 and layout.fsdp_shard == 1 and not isinstance(offload, CPUOffloadPolicy)
            and all(p.dtype == compute_dtype for p in module.parameters()))


def parallelize(module: nn.Module, dims: ParallelDims, compute_dtype: torch.dtype,
                offload: OffloadPolicy | None = None) -> nn.Module:
    """Shard `module` (which exposes `decoder.layers`) in place with FSDP2 and return it."""
    # cast_forward_inputs=False: FSDP would rebuild dataclass kwargs (the SP context) as copies, so the
    # attention layers would no longer share one context and its counters; the activations already
    # have the compute dtype because the parameters producing them do.
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    mesh, offload = dims.fsdp_mesh, offload or OffloadPolicy()
    for layer in module.decoder.layers:
        # expert-parallel experts: sharded over the ranks holding the same experts (rlsp.parallel.expert_parallel)
        for experts in (m for m in layer.modules() if hasattr(m, "rlsp_expert_shard")):
            fully_shard(experts, mesh=dims.ep_replicate_mesh, mp_policy=policy, offload_policy=offload)
        fully_shard(layer, mesh=mesh, mp_policy=policy, offload_policy=offload)
    fully_shard(module, mesh=mesh, mp_policy=policy, offload_policy=offload)
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
            m.set_gradient_divide_factor(1.0)
    return module


def all_reduce_gradients(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Sum the gradients of `module`'s trainable parameters over `group` (default: every rank), one
    flat all-reduce per dtype and device. A rank without a gradient for a parameter adds zeros; a
    parameter that no rank has a gradient for keeps none (a flag per parameter travels in the same
    buffer), as the optimizer then skips it on every rank alike."""
    params = [p for p in module.parameters() if p.requires_grad]
    kinds: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in params:
        kinds.setdefault((p.dtype, p.device), []).append(p)
    for (dtype, device), group_params in kinds.items():
        parts = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=dtype, device=device)
                 for p in group_params]
        flags = torch.tensor([p.grad is not None for p in group_params], dtype=dtype, device=device)
        flat = torch.cat([*parts, flags])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        had = flat[-len(group_params):].tolist()
        offset = 0
        for p, seen in zip(group_params, had):
            n = p.numel()
            if seen:
                summed = flat[offset:offset + n].view_as(p)
                if p.grad is None:
                    p.grad = summed.clone()
                else:
                    p.grad.copy_(summed)
            offset += n
