"""Expert parallelism for transformers' MoE blocks: an experts implementation registered as `rlsp_ep`.

transformers 5.19 computes a MoE layer's experts through a registry (`ExpertsInterface`): every experts class
decorated with `use_experts_implementation` (qwen2_moe, qwen3_moe, mixtral, olmoe, glm4_moe, deepseek_v3,
gpt_oss, ...) calls the function its config's `_experts_implementation` names with (hidden states, top-k expert
ids, top-k weights) after the family's own router has chosen them. rlsp registers one more function there, so no
model code is patched and the router, its top-k and renormalisation stay the family's:

  1. `apply_expert_parallel(model, group)` gives each rank of an expert-parallel group of size ep the experts
     [ep_rank * E/ep, (ep_rank + 1) * E/ep) of every MoE layer: every expert tensor (dim 0 = E: fused
     gate/up, down, their biases) is sliced on dim 0, `num_experts` becomes the local count, and the module
     remembers its `ExpertShard` (the group and the implementation that computed it before: eager, grouped_mm
     or batched_mm -- the family's own expert math runs on the local experts);
  2. `ep_experts_forward` (the registered function): the (token, expert) pairs are sorted by expert, hence by
     owning rank; counts are exchanged, then the tokens' hidden states go to their experts' ranks in one
     all-to-all (autograd: gradients flow back the same way), the local experts compute them with weight 1, a
     second all-to-all brings the outputs home, and each token's outputs are weighted by its routing weights and
     summed, as the family does. Every rank of the group calls both all-to-alls in every MoE layer, with or
     without tokens for a peer, so forward and backward collectives always match.

Each rank routes only its own tokens: its rows (dp) or its sequence shard (Ulysses / ring), so the dispatch unit
is the sequence shard. Parameters: the engine (rlsp.engine.parallelize) shards each experts module with FSDP2 over
the ranks holding the same experts (`ParallelDims.ep_replicate_mesh`), whose summed gradients are then the full
gradient of those experts; `gather_full` concatenates the ep slices of one tensor back into the HF tensor for
weight sync, export and tests.

Legend: N local tokens, K experts per token, S = N*K (token, expert) pairs, M pairs received, H hidden size,
E experts of a layer, L = E/ep local experts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

EP_EXPERTS_IMPL = "rlsp_ep"


@dataclass
class ExpertShard:
    """One experts module's place in its expert-parallel group."""

    group: dist.ProcessGroup
    ep_size: int
    ep_rank: int
    num_experts: int  # E: the layer's experts, over all ranks
    inner: Callable[..., torch.Tensor]  # the implementation the module used before: runs the local experts
    sharded: tuple[str, ...]  # names of the module's parameters sliced on dim 0

    @property
    def local(self) -> int:
        return self.num_experts // self.ep_size


def expert_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every experts module that computes through transformers' experts registry."""
    for name, module in model.named_modules():
        if hasattr(module, "_is_expert_parallel") and hasattr(module, "num_experts"):
            yield name, module


def _inner_implementation(module: nn.Module) -> Callable[..., torch.Tensor]:
    name = getattr(module.config, "_experts_implementation", None) or "eager"
    if name == EP_EXPERTS_IMPL:
        raise ValueError(f"{type(module).__name__} is already expert-parallel (apply_expert_parallel ran twice)")
    if name == "eager":
        return type(module).forward.__wrapped__  # the family's own loop (use_experts_implementation wraps it)
    return ALL_EXPERTS_FUNCTIONS[name]


def apply_expert_parallel(model: nn.Module, group: dist.ProcessGroup) -> list[nn.Module]:
    """Keep this rank's share of every MoE layer's experts and route them through `rlsp_ep` (in place; before
    FSDP). Returns the experts modules; raises when `model` has none or ep does not divide a layer's experts."""
    ep_size, ep_rank = dist.get_world_size(group), dist.get_rank(group)
    found = list(expert_modules(model))
    if not found:
        raise ValueError(f"expert_parallel_size={ep_size} but {type(model).__name__} has no experts module that "
                         "computes through transformers' experts registry; legal value for this model: 1")
    ALL_EXPERTS_FUNCTIONS.register(EP_EXPERTS_IMPL, ep_experts_forward)
    inner = [_inner_implementation(module) for _, module in found]  # before any config names rlsp_ep
    for (name, module), inner_fn in zip(found, inner):
        total = int(module.num_experts)
        if total % ep_size:
            legal = [d for d in range(1, total + 1) if total % d == 0]
            raise ValueError(f"expert_parallel_size={ep_size} does not divide the {total} experts of {name}; "
                             f"legal values: {legal}")
        lo, hi = ep_rank * total // ep_size, (ep_rank + 1) * total // ep_size
        sharded = tuple(n for n, p in module.named_parameters(recurse=False) if p.dim() and p.shape[0] == total)
        for pname in sharded:
            param = getattr(module, pname)
            setattr(module, pname, nn.Parameter(param.detach()[lo:hi].clone(), requires_grad=param.requires_grad))
        shard = ExpertShard(group, ep_size, ep_rank, total, inner_fn, sharded)
        module.num_experts = shard.local
        module.rlsp_expert_shard = shard
        module.config._experts_implementation = EP_EXPERTS_IMPL
    return [module for _, module in found]


def _exchange(values: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """All-to-all of rows without autograd (counts, expert ids)."""
    out = values.new_empty((sum(recv), *values.shape[1:]))
    dist.all_to_all_single(out, values.contiguous(), recv, send, group=group)
    return out


def _exchange_grad(values: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """All-to-all of rows whose gradient flows back along the same routes."""
    out = values.new_empty((sum(recv), *values.shape[1:]))
    if not torch.is_grad_enabled():
        dist.all_to_all_single(out, values.contiguous(), recv, send, group=group)
        return out
    return dist_nn.all_to_all_single(out, values.contiguous(), recv, send, group=group)


def _local_experts(module: nn.Module, shard: ExpertShard, x_MH: torch.Tensor, ids_M: torch.Tensor) -> torch.Tensor:
    """The family's expert math on the received pairs (weight 1: the weighting happens at home)."""
    ones_M1 = torch.ones(len(ids_M), 1, dtype=x_MH.dtype, device=x_MH.device)
    y_MH = shard.inner(module, x_MH, ids_M[:, None], ones_M1)
    if len(ids_M) == 0:  # keep this rank in backward's all-to-all and give its experts a (zero) gradient
        anchor = x_MH.sum() + sum(p.sum() for p in module.parameters(recurse=False) if p.requires_grad)
        y_MH = y_MH + 0 * anchor
    return y_MH


def ep_experts_forward(self: nn.Module, hidden_NH: torch.Tensor, top_k_index_NK: torch.Tensor,
                       top_k_weights_NK: torch.Tensor) -> torch.Tensor:
    """transformers' experts signature: this rank's tokens through experts spread over the expert-parallel group."""
    shard: ExpertShard = self.rlsp_expert_shard
    group, num_k = shard.group, top_k_index_NK.shape[-1]
    expert_S = top_k_index_NK.reshape(-1).long()
    order_S = torch.argsort(expert_S, stable=True)  # by expert, hence by owning rank
    sorted_S = expert_S[order_S]
    send_E = torch.bincount(sorted_S // shard.local, minlength=shard.ep_size)
    recv_E = _exchange(send_E, [1] * shard.ep_size, [1] * shard.ep_size, group)
    send, recv = send_E.tolist(), recv_E.tolist()
    ids_M = _exchange(sorted_S % shard.local, send, recv, group)
    x_MH = _exchange_grad(hidden_NH[order_S // num_k], send, recv, group)
    y_MH = _local_experts(self, shard, x_MH, ids_M)
    back_SH = _exchange_grad(y_MH.to(hidden_NH.dtype), recv, send, group)
    inverse_S = torch.empty_like(order_S)
    inverse_S[order_S] = torch.arange(len(order_S), device=order_S.device)
    y_NKH = back_SH[inverse_S].view(hidden_NH.shape[0], num_k, -1)
    out_NH = (y_NKH * top_k_weights_NK[..., None].to(y_NKH.dtype)).sum(dim=1)
    return out_NH.to(hidden_NH.dtype)


def expert_sharded_names(model: nn.Module) -> dict[str, ExpertShard]:
    """Full parameter name -> its module's ExpertShard, for every parameter sliced by `apply_expert_parallel`."""
    out: dict[str, ExpertShard] = {}
    for name, module in expert_modules(model):
        shard = getattr(module, "rlsp_expert_shard", None)
        for pname in shard.sharded if shard is not None else ():
            out[f"{name}.{pname}" if name else pname] = shard
    return out


def gather_full(local: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
    """The whole expert tensor [E, ...] from every rank's slice [E/ep, ...] (collective over the ep group)."""
    parts = [torch.empty_like(local) for _ in range(shard.ep_size)]
    dist.all_gather(parts, local.contiguous(), group=shard.group)
    return torch.cat(parts, dim=0)

