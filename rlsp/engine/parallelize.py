"""Apply FSDP2 to a head model: each decoder layer and the root are sharded over the role's FSDP mesh
(every rank but the tensor-parallel dimension, or HSDP groups of `fsdp_size` of them; see ParallelDims).

Master weights stay in their load dtype (fp32 for trainable models); `MixedPrecisionPolicy` casts
them to the compute dtype when FSDP all-gathers them for a forward, and gradients are reduced in
fp32. An offload policy (rlsp.engine.fsdp_offload) keeps the shards, gradients and hence the
optimizer state in host memory. Gradient reduction SUMS over ranks (FSDP's division turned off):
each rank's loss is already its share of the global token-mean, so the reduced gradient is exact for
any dp x sp x micro-batching.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from rlsp.parallel.mesh import ParallelDims


def parallelize(module: nn.Module, dims: ParallelDims, compute_dtype: torch.dtype,
                offload: OffloadPolicy | None = None) -> nn.Module:
    """Shard `module` (which exposes `decoder.layers`) in place with FSDP2 and return it."""
    # cast_forward_inputs=False: FSDP would rebuild dataclass kwargs (the SP context) as copies, so the
    # attention layers would no longer share one context and its counters; the activations already
    # have the compute dtype because the parameters producing them do.
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    mesh, offload = dims.fsdp_mesh, offload or OffloadPolicy()
    for layer in module.decoder.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, offload_policy=offload)
    fully_shard(module, mesh=mesh, mp_policy=policy, offload_policy=offload)
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
            m.set_gradient_divide_factor(1.0)
    return module
