"""Tensor-parallel styles for the families beyond Llama/Qwen2 (rlsp.parallel.tensor_parallel's layer plan uses them).

- `HeadShardedNorm`: a per-head q/k norm (Gemma 3's, Qwen3-MoE's and GLM-4-MoE's q_norm / k_norm: RMSNorm over
  head_dim, one weight for all heads) on this tp rank's heads; the weight is replicated and its gradient a Partial
  sum over tp.
- `ProjectionShardedNorm`: OLMoE's q_norm / k_norm, an RMSNorm over the whole projection (Hq*D or Hkv*D features),
  on this tp rank's column shard: the weight is sharded like the projection's columns and the mean of squares is
  summed over tp (an all-reduce of [S, 1] per norm, each way).
- `LocalReplicatedMoE`: a sparse mixture-of-experts block run on plain local tensors on all the micro-batch's
  tokens. Where rlsp.parallel.tp_experts can split its routed experts over tp by their width (the fused bias-free
  experts of its SPLIT_EXPERT_FAMILIES, widths tp divides into aligned shares: `split_expert_block`) it applies
  that style (`SplitExpertsMoE`: expert tensor parallelism, a tp rank holds 1/tp of every expert); otherwise
  (gpt_oss, other widths) the router and routed experts are replicated over tp: exact, not memory-saving for the
  routed experts, and the shared experts inside it (qwen2_moe, glm4_moe, deepseek_v2 / v3, qwen3_next,
  qwen3_5_moe) are split over tp like a dense MLP (`shard_shared_experts`). A family's dense layers (glm4_moe's /
  deepseek's first_k_dense_replace, qwen2/3_moe's mlp_only_layers) keep the column/row-parallel MLP plan:
  `sparse_moe_block` tells them apart.
- `shard_sinks`: attention sinks (gpt-oss, one logit per q head) sharded over tp like q_proj's heads.
Verified exact in tests/distributed/test_tp_window_exact.py (gemma, gpt_oss) and test_tp_moe_exact.py (the MoE
families) for the families listed below.

Legend: S tokens of the sp shard fed to the decoder, h hidden size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.nn.functional as dist_nn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle

from rlsp.parallel.tp_experts import SplitExpertsMoE, split_expert_block
from rlsp.parallel.tp_local import route_dtensor_calls

SEQ_DIM = 1  # activations inside the decoder are [1, tokens, hidden]


def replicate_params(module: nn.Module, mesh: DeviceMesh) -> None:
    """`module`'s own parameters as Replicate DTensors over tp (from tp rank 0)."""
    for name, param in list(module.named_parameters(recurse=False)):
        if not isinstance(param, DTensor):
            replicated = distribute_tensor(param.data, mesh, [Replicate()])
            module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))


# families whose per-head q/k norms (RMSNorm over head_dim, one weight shared by all heads) run on this tp rank's
# heads: verified exact in tests/distributed/test_tp_window_exact.py, test_tp_moe_exact.py (glm4_moe: use_qk_norm) and
# test_tp_linear_exact.py (the gated full-attention layers of qwen3_next / qwen3_5)
HEAD_NORM_FAMILIES = ("gemma3_text", "qwen3_moe", "glm4_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# families whose q/k norms normalise the whole projection (Hq*D / Hkv*D features): ProjectionShardedNorm
PROJECTION_NORM_FAMILIES = ("olmoe",)
# families whose sparse mixture-of-experts blocks run on local tensors over tp (LocalReplicatedMoE: routed experts
# split by rlsp.parallel.tp_experts where it can, else replicated): verified exact in
# test_tp_moe_exact.py, test_tp_mla_exact.py (deepseek_v2 / v3) and test_tp_linear_exact.py (qwen3_next, qwen3_5_moe)
REPLICATED_MOE_FAMILIES = ("gpt_oss", "qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v2",
                           "deepseek_v3", "qwen3_next", "qwen3_5_moe_text")


def sparse_moe_block(mlp: nn.Module, model_type: str) -> bool:
    """True for a layer's sparse MoE block (it holds routed `experts`) of a REPLICATED_MOE_FAMILIES model; False
    for a dense MLP (gate/up/down projections), which keeps the column/row-parallel plan."""
    return model_type in REPLICATED_MOE_FAMILIES and hasattr(mlp, "experts")


def qk_norm_plan(attn: nn.Module, model_type: str) -> dict[str, ParallelStyle]:
    """The plan entries of an attention block's q_norm / k_norm ({} without them, or for a family whose norms are
    not verified: its plain parameters then fail the layer's all-distributed check, naming them)."""
    if not hasattr(attn, "q_norm"):
        return {}
    style = (HeadShardedNorm if model_type in HEAD_NORM_FAMILIES else
             ProjectionShardedNorm if model_type in PROJECTION_NORM_FAMILIES else None)
    return {} if style is None else {"self_attn.q_norm": style(), "self_attn.k_norm": style()}


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


class ProjectionShardedNorm(ParallelStyle):
    """An RMSNorm over a whole projection (OLMoE's q_norm over Hq*D features, k_norm over Hkv*D; T5-style:
    weight * x / sqrt(mean(x^2) + eps)) applied to this tp rank's column shard [..., n/tp] (ColwiseParallel's local
    output): its weight is sharded like those columns (Shard(0)) and the sum of squares is all-reduced over tp, a
    [..., 1] statistic each way (backward: the statistic's gradient summed over the ranks that read it). The
    module's own forward on a Shard(-1) DTensor computes the same but reduce-scatters an [..., n] gradient in
    backward, hence the explicit form. Output: this rank's plain local shard."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        eps = getattr(module, "variance_epsilon", None)
        if not isinstance(eps, float) or tuple(module._parameters) != ("weight",):
            raise ValueError(f"{type(module).__name__} is not an RMSNorm with one weight and `variance_epsilon`; "
                             "ProjectionShardedNorm splits only that form (OLMoE's q_norm / k_norm)")
        width = module.weight.shape[0]
        sharded = distribute_tensor(module.weight.data, device_mesh, [Shard(0)])
        module.register_parameter("weight", nn.Parameter(sharded, requires_grad=module.weight.requires_grad))
        group = device_mesh.get_group()

        def forward(x_local: torch.Tensor) -> torch.Tensor:
            x32 = x_local.to(torch.float32)
            sum_sq = dist_nn.all_reduce(x32.pow(2).sum(-1, keepdim=True), group=group)
            normed = x32 * torch.rsqrt(sum_sq / width + eps)
            return module.weight.to_local() * normed.to(x_local.dtype)

        module.forward = forward
        return module


class LocalReplicatedMoE(ParallelStyle):
    """A sparse mixture-of-experts block (router + experts: GptOssMLP, Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock,
    OlmoeSparseMoeBlock; with shared experts Qwen2MoeSparseMoeBlock, Glm4MoeMoE) replicated over tp and run on plain
    local tensors (its data-dependent routing has no DTensor rules). Every tp rank routes all S tokens, as without
    tensor parallelism (so the router hooks of rlsp.engine.moe_load / router_replay see the micro-batch's
    tokens): under sequence parallelism the block all-gathers its input (backward: a reduce-scatter) and keeps
    its own [S/tp] slice of the output, so its parameters' and input's gradients are Partial over tp (own
    tokens' share); otherwise every rank computes the same complete gradients (Replicate). Exact, not
    memory-saving: every tp rank holds every routed expert (shared experts: split, `shard_shared_experts`). A block
    whose routed experts rlsp.parallel.tp_experts can split (`split_expert_block`) gets `SplitExpertsMoE` instead."""

    def __init__(self, seq: Placement, model_type: str) -> None:
        super().__init__()
        self.seq, self.model_type = seq, model_type

    def _run(self, module: nn.Module, hidden: DTensor, args: tuple, kwargs: dict) -> Any:
        grad_placements = (Partial(),) if self.seq.is_shard() else (Replicate(),)
        full = hidden.redistribute(placements=[Replicate()]) if hidden.placements != (Replicate(),) else hidden
        # a tp-sharded shared expert's weight gradients are complete for their shard (see shard_shared_experts)
        local = {n: p.to_local(grad_placements=None if any(pl.is_shard() for pl in p.placements) else grad_placements)
                 for n, p in module.named_parameters()}
        out = torch.func.functional_call(module, local, (full.to_local(grad_placements=grad_placements), *args),
                                         kwargs)
        first = out[0] if isinstance(out, tuple) else out
        if self.seq.is_shard():  # this rank's contiguous token block of [1, S, h]
            n = first.shape[SEQ_DIM] // hidden.device_mesh.size()
            first = first.narrow(SEQ_DIM, hidden.device_mesh.get_local_rank() * n, n)
        first = DTensor.from_local(first, hidden.device_mesh, [self.seq], run_check=False)
        return (first, *out[1:]) if isinstance(out, tuple) else first

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if split_expert_block(module, self.model_type, device_mesh.size()):  # routed experts split over tp instead
            return SplitExpertsMoE(self.seq)._apply(module, device_mesh)
        shard_shared_experts(module, device_mesh, self.seq)
        for sub in module.modules():
            replicate_params(sub, device_mesh)
        route_dtensor_calls(module, lambda args, kwargs: self._run(module, args[0], args[1:], kwargs))
        return module


def shard_shared_experts(block: nn.Module, mesh: DeviceMesh, seq: Placement) -> int:
    """Split the shared experts of a sparse MoE block (qwen2_moe's `shared_expert`, glm4_moe's `shared_experts`: a
    gated MLP beside the routed experts) over tp like a dense MLP: gate/up column-parallel (Shard(0)), down
    row-parallel (Shard(1)), inside the block's local run. Their partial outputs are all-reduced over tp; under
    sequence parallelism that all-reduce's backward sums the ranks' own-token gradient shares (the block's input
    gradient stays a Partial share), otherwise every rank holds the complete output gradient (backward: identity)
    and the input gets Megatron's f operator (identity forward, all-reduce backward) so its gradient is complete.
    A shard's weight gradient covers every token: complete for that shard. Left replicated where the shared width
    is not a multiple of tp or a projection has a bias. Returns how many were split."""
    out_grad = Partial() if seq.is_shard() else Replicate()

    def full_input(module: nn.Module, args: tuple) -> tuple:
        if seq.is_shard():  # the block's input gradient is a Partial share already
            return args
        x = DTensor.from_local(args[0], mesh, [Replicate()], run_check=False)
        return (x.to_local(grad_placements=(Partial(),)), *args[1:])

    def summed_output(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        partial = DTensor.from_local(out, mesh, [Partial()], run_check=False)
        return partial.redistribute(placements=[Replicate()]).to_local(grad_placements=(out_grad,))

    split = 0
    for name in ("shared_expert", "shared_experts"):
        mlp = getattr(block, name, None)
        projections = [getattr(mlp, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(p, nn.Linear) and p.bias is None for p in projections):
            continue
        if projections[0].out_features == 0 or projections[0].out_features % mesh.size():
            continue
        for linear, dim in zip(projections, (0, 0, 1)):
            sharded = distribute_tensor(linear.weight.data, mesh, [Shard(dim)])
            linear.register_parameter("weight", nn.Parameter(sharded, requires_grad=linear.weight.requires_grad))
        mlp.register_forward_pre_hook(full_input)
        mlp.register_forward_hook(summed_output)
        split += 1
    return split


def shard_sinks(attn: nn.Module, mesh: DeviceMesh) -> None:
    """gpt-oss's attention sinks (one logit per q head) sharded over tp like q_proj's heads: Shard(0), a tp rank
    holds its Hq/tp heads' sinks (attention reads the local slice)."""
    sinks = getattr(attn, "sinks", None)
    if isinstance(sinks, nn.Parameter) and not isinstance(sinks, DTensor):
        sharded = distribute_tensor(sinks.data, mesh, [Shard(0)])
        attn.register_parameter("sinks", nn.Parameter(sharded, requires_grad=sinks.requires_grad))
