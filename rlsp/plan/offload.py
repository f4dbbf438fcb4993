"""What FSDP parameter offload puts in host memory, and what it copies over PCIe per micro-batch.

With `fsdp_config.param_offload=true` (rlsp/engine/fsdp_offload.py: FSDP2's CPUOffloadPolicy, for the
trainable roles together with the optimizer state) every role's parameter shards, reduced gradient
shards and AdamW moments live in host memory and the optimizer step runs on the CPU. The device
keeps what FSDP2 is computing with: the layers in flight (their fp32 shards copied in, cast and
all-gathered), the root unit from forward to the end of backward, a layer's gradient shard on its way
out (memory.offload_staging_bytes), activations and the head.

Host memory per node (bytes; P the parameters of one rank's shard, all its roles):
  trainable role  fp32 master 4 + AdamW moments 8 + fp32 gradient 4 per parameter, plus AdamW's
                  foreach temporaries in the CPU step (one fp32 tensor per parameter, as on the device)
  reference       compute dtype e per parameter
  activations     with activation offload, every layer's checkpointed input (layers x s x hidden x e)
times the ranks of a node. A plan whose host bytes exceed the node's usable host memory is refused.

PCIe bytes per rank and micro-batch of a trainable role: each layer's fp32 shard is copied in for the
forward and again for the backward (FSDP2 frees the gathered weights after the forward), its fp32
gradient shard copied out; the root unit once each way. The CPU AdamW step runs once per optimizer
step (not per micro-batch) and is not in the per-micro-batch time the search ranks by.
"""

from __future__ import annotations

from rlsp.config.layout import RoleLayout
from rlsp.config.model_shape import ModelShape
from rlsp.plan.memory import MemoryOptions, Workload, state_bytes, tp_replicated


def host_bytes_per_rank(shape: ModelShape, w: Workload, opts: MemoryOptions, critic: bool, ref: bool) -> dict[str, float]:
    """Named host-memory terms of one rank (bytes): offloaded role state and offloaded activations."""
    e, terms = opts.dtype_bytes, {}
    if opts.param_offload:
        roles = ["actor"] + ["ref"] * ref + ["critic"] * critic
        for role in roles:
            state, grads = state_bytes(shape, w.layout, role, e)
            terms[f"{role} state"] = state + grads  # parameter shards, optimizer state, gradient shards
            if grads:  # AdamW's foreach temporaries in the CPU step, one fp32 tensor per parameter
                terms[f"{role} AdamW temporaries"] = grads
    if opts.activation_offload:
        terms["offloaded activations"] = shape.layers * w.kept * shape.hidden * e
    return terms


def host_bytes_per_node(shape: ModelShape, w: Workload, opts: MemoryOptions, critic: bool, ref: bool) -> float:
    """Host memory of one node: every rank's terms (all ranks of a node run the same layout)."""
    return sum(host_bytes_per_rank(shape, w, opts, critic, ref).values()) * w.layout.world.procs_per_node


def offload_copy_bytes(shape: ModelShape, layout: RoleLayout, role: str) -> float:
    """Bytes one rank moves between host and device per micro-batch for a trainable role's offloaded
    parameters: fp32 shards in twice (forward, backward) and fp32 gradient shards out once per layer,
    the root unit's shard in once and its gradient out once."""
    root = shape.critic_root_params if role == "critic" else shape.root_params
    whole = sum(tp_replicated(shape, k, layout) for k in shape.kinds)  # MoE blocks under tp: not split
    layers = ((shape.decoder_params - whole) / layout.tp + whole) / layout.fsdp_shard
    return layers * (2 * 4 + 4) + root / layout.fsdp_shard * (4 + 4)
