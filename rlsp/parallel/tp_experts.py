"""Expert tensor parallelism: a sparse MoE block's routed experts split over tp by their intermediate dimension.

The families of SPLIT_EXPERT_FAMILIES hold their routed experts as transformers' fused tensors, bias-free:
`experts.gate_up_proj` [E, 2I, h] ([gate I | up I] per expert) and `experts.down_proj` [E, h, I], and every expert
implementation (eager loop, batched_mm, grouped_mm) splits gate from up by `.chunk(2, dim=-1)` and takes its
sizes from the weights. `SplitExpertsMoE`, applied at a layer's sparse MoE block, gives tp rank r of tp ranks
I/tp features of every expert, Megatron's expert tensor parallelism:
  - gate_up_proj: rows [r*I/tp, (r+1)*I/tp) of the gate block and the same rows of the up block, i.e. chunks r and
    r+tp of 2*tp: torch's `_StridedShard(1, split_factor=2)`, so the local [E, 2I/tp, h] is again [gate | up]
    (FSDP2 shards it over dp by dim 0 on top; full_tensor gathers the fused layout back; torch.distributed.checkpoint
    cannot describe a rank's two blocks: `convert_strided_state` makes them contiguous Shard(1) pieces for it);
  - down_proj: its input columns, Shard(2);
  - shared experts (gate/up Shard(0), down Shard(1), as a dense MLP) join the routed experts' partial output;
  - the router (and qwen2_moe's / qwen3_next's shared-expert gate) replicated: every tp rank routes the same S
    tokens, so routing replay and the expert-load and router-loss hooks see what they see without tp.
The block's output is a partial sum over tp: one all-reduce, or under sequence parallelism one reduce-scatter to
this rank's [S/tp] tokens, whose backward hands every rank the complete output gradient of all S tokens; a split
weight's gradient is then complete for its shard. The replicated paths' gradients follow LocalReplicatedMoE's
convention (the router's auxiliary loss, rlsp.engine.router_aux, relies on it):
  - sequence parallel: the block input is all-gathered (backward: a reduce-scatter) and every replicated
    parameter's and the input's gradient is Partial over tp (this rank's experts' share);
  - otherwise they are complete (Replicate) on every rank: the routing weights' gradient [S, K] and the shared
    gate's output gradient [S, 1] are all-reduced, and the routed and shared experts read the input through
    Megatron's f (identity forward, all-reduce of their partial input gradient [S, h] backward: two of them with
    shared experts, each of its own path's share).
Used where tp divides the expert width and the shared width into multiples of ALIGN (`width_splits`) and the
block holds only these parts (`split_expert_block`); otherwise rlsp.parallel.tp_families.LocalReplicatedMoE
runs the block replicated.

Legend: S tokens of the sp shard fed to the decoder, h hidden size, E routed experts, I expert width,
K experts per token.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from rlsp.parallel.tp_local import route_dtensor_calls

# families whose routed experts are fused, bias-free [gate | up] tensors split by `.chunk(2, dim=-1)`: verified
# exact in tests/distributed/test_tp_experts_exact.py and the tp tests of each family (gpt_oss: interleaved
# gate/up with biases, kept replicated)
SPLIT_EXPERT_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v2", "deepseek_v3",
                         "qwen3_next", "qwen3_5_moe_text")
# transformers' grouped_mm experts (its default, CPU included) need 16-byte-aligned strides: a split keeps the
# local width a multiple of 8 elements (16 bytes of bf16)
ALIGN = 8
SHARED = ("shared_expert", "shared_experts")
# the block's parts this style knows how to run; any other parameter keeps the block replicated
PARTS = ("gate", "experts", *SHARED, "shared_expert_gate")


def width_splits(width: int, tp: int) -> bool:
    """True when tp splits an expert width: tp divides it into local widths of a multiple of ALIGN."""
    return width > 0 and width % tp == 0 and (width // tp) % ALIGN == 0


def _shared_ok(mlp: nn.Module | None, tp: int) -> bool:
    """A gated, bias-free shared MLP whose width tp divides (or none)."""
    if mlp is None:
        return True
    projections = [getattr(mlp, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
    return (all(isinstance(p, nn.Linear) and p.bias is None for p in projections)
            and width_splits(projections[0].out_features, tp))


def split_expert_block(block: nn.Module, model_type: str, tp: int) -> bool:
    """True when `block` (a sparse MoE block) can run with its routed experts split over `tp` ranks."""
    experts = getattr(block, "experts", None)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if model_type not in SPLIT_EXPERT_FAMILIES or not isinstance(gate_up, nn.Parameter) or not isinstance(down, nn.Parameter):
        return False
    fused = (gate_up.dim() == 3 and down.dim() == 3 and not getattr(experts, "has_bias", False)
             and getattr(experts, "is_concatenated", True) and not getattr(experts, "is_transposed", False))
    width = down.shape[2]
    return (fused and width_splits(width, tp) and gate_up.shape[1] == 2 * width
            and all(_shared_ok(getattr(block, n, None), tp) for n in SHARED)
            and all(name.split(".")[0] in PARTS for name, _ in block.named_parameters()))


def _shard(module: nn.Module, name: str, mesh: DeviceMesh, placement: Placement) -> None:
    param = getattr(module, name)
    sharded = distribute_tensor(param.data, mesh, [placement])
    module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def _megatron_f(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; backward all-reduces x's gradient over tp (each rank's is a partial share)."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=(Partial(),))


def _complete_grads_hooks(block: nn.Module, mesh: DeviceMesh) -> None:
    """Without sequence parallelism: all-reduce the partial gradients of what the replicated paths hand the split
    ones (the experts' and shared experts' input, the routing weights, the shared gate's output)."""
    def experts_in(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args = (_megatron_f(args[0], mesh), *args[1:])
        if len(args) > 2:
            args = (*args[:2], _megatron_f(args[2], mesh), *args[3:])
        elif "top_k_weights" in kwargs:
            kwargs = {**kwargs, "top_k_weights": _megatron_f(kwargs["top_k_weights"], mesh)}
        return args, kwargs

    block.experts.register_forward_pre_hook(experts_in, with_kwargs=True)
    for name in SHARED:
        if getattr(block, name, None) is not None:
            getattr(block, name).register_forward_pre_hook(lambda m, args: (_megatron_f(args[0], mesh), *args[1:]))
    if getattr(block, "shared_expert_gate", None) is not None:
        block.shared_expert_gate.register_forward_hook(lambda m, args, out: _megatron_f(out, mesh))


class SplitExpertsMoE(ParallelStyle):
    """A sparse MoE block with its routed and shared experts split over tp (see the module docstring); `seq`: the
    residual stream's layout (Shard(1): sequence parallel, Replicate otherwise). Output: a DTensor in it."""

    def __init__(self, seq: Placement) -> None:
        super().__init__()
        self.seq = seq

    def _run(self, module: nn.Module, hidden: DTensor, args: tuple, kwargs: dict) -> Any:
        grad = (Partial(),) if self.seq.is_shard() else (Replicate(),)
        full = hidden.redistribute(placements=[Replicate()]) if hidden.placements != (Replicate(),) else hidden
        # a split weight's gradient is complete for its shard (_StridedShard is no Shard: test for Replicate)
        local = {n: p.to_local(grad_placements=None if p.placements != (Replicate(),) else grad)
                 for n, p in module.named_parameters()}
        out = torch.func.functional_call(module, local, (full.to_local(grad_placements=grad), *args), kwargs)
        first = out[0] if isinstance(out, tuple) else out
        partial = DTensor.from_local(first, hidden.device_mesh, [Partial()], run_check=False)
        first = partial.redistribute(placements=[self.seq])
        return (first, *out[1:]) if isinstance(out, tuple) else first

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        experts = getattr(module, "experts", None)
        model_type = getattr(getattr(experts, "config", None), "model_type", "")
        if not split_expert_block(module, model_type, device_mesh.size()):
            down = getattr(experts, "down_proj", None)
            width = down.shape[-1] if isinstance(down, torch.Tensor) else None
            raise ValueError(f"{type(module).__name__} (model type {model_type!r}, expert width {width}) has no routed "
                             f"experts that tensor_model_parallel_size={device_mesh.size()} can split; legal: the "
                             f"fused bias-free experts of {list(SPLIT_EXPERT_FAMILIES)} whose expert and shared "
                             f"widths tp divides into multiples of {ALIGN}")
        _shard(module.experts, "gate_up_proj", device_mesh, _StridedShard(1, split_factor=2))
        _shard(module.experts, "down_proj", device_mesh, Shard(2))
        for mlp in (getattr(module, n, None) for n in SHARED):
            for name, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)) if mlp is not None else ():
                _shard(getattr(mlp, name), "weight", device_mesh, Shard(dim))
        for sub in module.modules():  # the router, the shared gate
            for name, param in list(sub.named_parameters(recurse=False)):
                if not isinstance(param, DTensor):
                    _shard(sub, name, device_mesh, Replicate())
        if not self.seq.is_shard():
            _complete_grads_hooks(module, device_mesh)
        route_dtensor_calls(module, lambda args, kwargs: self._run(module, args[0], args[1:], kwargs))
        return module


def strided_placements(module: nn.Module) -> dict[str, tuple[Placement, ...]]:
    """{FQN: placements} of `module`'s parameters split with a `_StridedShard` (the routed experts' gate_up_proj)."""
    return {n: tuple(p.placements) for n, p in module.named_parameters()
            if isinstance(p, DTensor) and any(isinstance(pl, _StridedShard) for pl in p.placements)}


def _contiguous(placements: tuple[Placement, ...]) -> list[Placement]:
    return [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements]


def convert_strided_state(state: dict[str, Any], names: dict[str, tuple[Placement, ...]], to_checkpoint: bool) -> None:
    """In place: the model entries {fqn: tensor} and optimizer entries {"state": {fqn: {key: tensor}}} of the
    `names` parameters (`strided_placements`) redistributed to contiguous Shard placements (`to_checkpoint`: a
    rank's _StridedShard piece is two blocks of the HF tensor, which torch.distributed.checkpoint cannot describe;
    an all-to-all over tp) or back to the parameter's own placements (a local slice)."""
    def convert(value: Any, placements: tuple[Placement, ...]) -> Any:
        if not isinstance(value, DTensor) or value.dim() == 0:
            return value
        return value.redistribute(placements=_contiguous(placements) if to_checkpoint else list(placements))

    model = state.get("model", {})
    for fqn in [k for k in model if k in names]:
        model[fqn] = convert(model[fqn], names[fqn])
    optim_state = state.get("optimizer", {}).get("state", {})
    for fqn in [k for k in optim_state if k in names]:
        optim_state[fqn] = {k: convert(v, names[fqn]) for k, v in optim_state[fqn].items()}
