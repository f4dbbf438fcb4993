"""FSDP2 parameter offload (`fsdp_config.param_offload` / `offload_policy`): `CPUOffloadPolicy`.

With the policy, FSDP2 keeps every parameter shard and its gradient in host memory: before a layer
runs, its shards are copied to the device and all-gathered, afterwards the gathered weights are
freed, and gradients are reduce-scattered and copied back to the host. The optimizer state is
created next to its parameters, so it lives in host memory too and the optimizer step runs on the
CPU. Device memory then holds only the weights of the layers in flight, activations and the KV
cache. (verl's separate `optimizer_offload` cannot be had without the parameters under FSDP2: see
rlsp/config/validate_offload.py for how the keys map.)

FSDP's collectives over parameters and gradients run on device tensors (NCCL: a DTensor's
collectives follow the device its local shard is on), so anything computed from offloaded shards —
the gradient norm, full tensors for a weight sync — is moved to the device first (`to_device`); on a
CPU run that is a no-op. On CPU everything already lives in host memory: the
policy is applied all the same (FSDP2 accepts it there and the tests exercise it) and the log says
once per role that it saves nothing.

Legend: none (no per-token tensors here).
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from rlsp.utils.device import same_device
from rlsp.utils.logging import get_logger, log_once

log = get_logger("rlsp.engine")


def build_offload_policy(enabled: bool, device: torch.device) -> OffloadPolicy:
    """FSDP2's policy for `fully_shard`: CPUOffloadPolicy (pinned host memory on CUDA) or none."""
    if not enabled:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def log_offload(role: str, enabled: bool, device: torch.device) -> None:
    """One line per role and process: what the offload does on this device."""
    if not enabled:
        return
    if device.type == "cpu":
        log_once(log, f"offload:{role}", "%s: FSDP parameter offload (CPUOffloadPolicy) has no effect on cpu: "
                 "parameters, gradients and optimizer state already live in host memory", role)
    else:
        log_once(log, f"offload:{role}", "%s: FSDP parameter offload: parameter shards, gradients and (trainable "
                 "roles) the optimizer state in host memory (CPUOffloadPolicy, whatever optimizer_offload says); the "
                 "optimizer step runs on the CPU", role)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (a DTensor shard or a plain tensor) on `device`, where its collectives can run; the
    tensor itself when it is there already."""
    return tensor if same_device(tensor.device, device) else tensor.to(device)
