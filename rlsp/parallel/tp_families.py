"""Tensor-parallel styles for the families beyond Llama/Qwen2 (rlsp.parallel.tensor_parallel's layer plan uses them).

- `HeadShardedNorm`: a per-head q/k norm (Gemma 3's q_norm / k_norm: RMSNorm over head_dim, one weight for all
  heads) on this tp rank's heads; the weight is replicated and its gradient a Partial sum over tp.
- `LocalReplicatedMoE`: a mixture-of-experts block (gpt-oss's router + experts) replicated over tp and run on
  plain local tensors on all the micro-batch's tokens; exact, not memory-saving.
- `shard_sinks`: attention sinks (gpt-oss, one logit per q head) sharded over tp like q_proj's heads.
Verified exact in tests/distributed/test_tp_window_exact.py for the families listed below.

Legend: S tokens of the sp shard fed to the decoder, h hidden size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle

SEQ_DIM = 1  # activations inside the decoder are [1, tokens, hidden]


def replicate_params(module: nn.Module, mesh: DeviceMesh) -> None:
    """`module`'s own parameters as Replicate DTensors over tp (from tp rank 0)."""
    for name, param in list(module.named_parameters(recurse=False)):
        if not isinstance(param, DTensor):
            replicated = distribute_tensor(param.data, mesh, [Replicate()])
            module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))


# families whose per-head q/k norms (RMSNorm over head_dim, one weight shared by all heads) run on this tp rank's
# heads: verified exact in tests/distributed/test_tp_window_exact.py (Qwen3's q_norm is the same math, not verified)
HEAD_NORM_FAMILIES = ("gemma3_text",)
# families whose mixture-of-experts block (mlp.router + mlp.experts) runs replicated over tp: verified exact there
# (other MoE families keep the dense plan's check, which refuses them by their missing mlp.gate_proj)
REPLICATED_MOE_FAMILIES = ("gpt_oss",)


class HeadShardedNorm(ParallelStyle):
    """A per-head norm (q_norm / k_norm) applied to this tp rank's heads: its weight is replicated over tp, the
    input (a plain tensor of the local heads) is taken as a shard of the full heads, so the weight's gradient
    is a Partial sum over the tp ranks' heads (summed by FSDP2 / reduce_tp_replicated_grads); the output is
    the plain local tensor again."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def prepare(mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            x = inputs[0]
            return (DTensor.from_local(x, mesh, [Shard(x.dim() - 2)], run_check=False), *inputs[1:])

        return distribute_module(module, device_mesh, lambda name, mod, mesh: replicate_params(mod, mesh),
                                 prepare, lambda mod, out, mesh: out.to_local())


class LocalReplicatedMoE(ParallelStyle):
    """A mixture-of-experts block (router + experts, e.g. GptOssMLP) replicated over tp and run on plain local
    tensors (its data-dependent routing has no DTensor rules). Every tp rank routes all S tokens, as without
    tensor parallelism (so the router hooks of rlsp.engine.moe_load / router_replay see the micro-batch's
    tokens): under sequence parallelism the block all-gathers its input (backward: a reduce-scatter) and keeps
    its own [S/tp] slice of the output, so its parameters' and input's gradients are Partial over tp (own
    tokens' share); otherwise every rank computes the same complete gradients (Replicate). Exact, not
    memory-saving: every tp rank holds every expert."""

    def __init__(self, seq: Placement) -> None:
        super().__init__()
        self.seq = seq

    def _run(self, module: nn.Module, hidden: DTensor, args: tuple, kwargs: dict) -> Any:
        grad_placements = (Partial(),) if self.seq.is_shard() else (Replicate(),)
        full = hidden.redistribute(placements=[Replicate()]) if hidden.placements != (Replicate(),) else hidden
        local = {n: p.to_local(grad_placements=grad_placements) for n, p in module.named_parameters()}
        out = torch.func.functional_call(module, local, (full.to_local(grad_placements=grad_placements), *args),
                                         kwargs)
        first = out[0] if isinstance(out, tuple) else out
        if self.seq.is_shard():  # this rank's contiguous token block of [1, S, h]
            n = first.shape[SEQ_DIM] // hidden.device_mesh.size()
            first = first.narrow(SEQ_DIM, hidden.device_mesh.get_local_rank() * n, n)
        first = DTensor.from_local(first, hidden.device_mesh, [self.seq], run_check=False)
        return (first, *out[1:]) if isinstance(out, tuple) else first

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for sub in module.modules():
            replicate_params(sub, device_mesh)
        plain_forward = module.forward

        def forward(hidden: Any, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(hidden, DTensor):  # re-entered by functional_call with local tensors
                return plain_forward(hidden, *args, **kwargs)
            return self._run(module, hidden, args, kwargs)

        module.forward = forward
        return module


def shard_sinks(attn: nn.Module, mesh: DeviceMesh) -> None:
    """gpt-oss's attention sinks (one logit per q head) sharded over tp like q_proj's heads: Shard(0), a tp rank
    holds its Hq/tp heads' sinks (attention reads the local slice)."""
    sinks = getattr(attn, "sinks", None)
    if isinstance(sinks, nn.Parameter) and not isinstance(sinks, DTensor):
        sharded = distribute_tensor(sinks.data, mesh, [Shard(0)])
        attn.register_parameter("sinks", nn.Parameter(sharded, requires_grad=sinks.requires_grad))
