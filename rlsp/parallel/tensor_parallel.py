"""Megatron-style tensor parallelism (TP) for rlsp's head models, optionally with sequence-parallel activations.

`apply_tensor_parallel(model, tp_mesh, sequence_parallel)` turns the parameters of a head model
(`rlsp.models.lm.TokenLogprobModel` or `rlsp.models.value.ValueModel`: anything with a HF decoder
at `model.decoder` made of Llama/Qwen2-style layers) into DTensors on the 1-D tp mesh, in place and
before FSDP2 shards them over the dp mesh. Per decoder layer:
  - q/k/v and gate/up projections are column-parallel: a tp rank holds Hq/tp, Hkv/tp heads and
    I/tp intermediate features, so attention (rlsp_ulysses) sees q [1, Hq/tp, S, D];
  - o_proj and down_proj are row-parallel: their partial outputs are summed over tp.
With `sequence_parallel=True` the residual stream (embedding output, norms, final norm) is sharded
along the tokens over tp: an all-gather before the column-parallel projections (which save only the
rank's [S/tp] input shard and re-gather it in backward: rlsp.parallel.tp_sp) and a reduce-scatter after
the row-parallel ones (Nanotron's tp_mode=REDUCE_SCATTER, Megatron's sequence parallelism), so the
decoder's final hidden state on a tp rank is its contiguous [S/tp] slice and the head runs on those tokens only. Without it the residual stream is replicated: all-reduce after the
row-parallel projections, and every tp rank computes the same full [S] output.

Everything else (embedding, norms, rotary buffers, `lm.lm_head`, the critic's value head) is
replicated over tp as Replicate DTensors; rotary embeddings are computed from the full position ids.
Gemma 2/3's extra norms are replicated like the others; per-head q/k norms (Gemma 3, Qwen3-MoE, GLM-4-MoE), OLMoE's
whole-projection q/k norms, gpt-oss's sinks (sharded like the q heads) and the sparse MoE blocks of the MoE families
(router replicated; routed experts split by their width, rlsp.parallel.tp_experts, or replicated where tp does not
split it; shared experts split like an MLP; dense layers take the MLP plan above): rlsp.parallel.tp_families. Multi-latent attention (deepseek_v2 / v3: heads split, latent projections replicated):
rlsp.parallel.tp_latent; Gated DeltaNet layers (qwen3_next, qwen3_5: split by key-head groups):
rlsp.parallel.tp_linear_attention. Both run their block on local tensors, their input gathered once per block.
The heads read their weights through `tp_local_param`, which declares how the local gradient relates
to the replicated one: under sequence parallelism each tp rank's gradient is a Partial sum over its
own tokens (DTensor computes the same Partial gradients for the embedding and the norms); without it
every rank computes the same, complete gradient (Replicate: nothing to sum, no double counting).
FSDP2 redistributes Partial gradients to the parameter's placement (an all-reduce over tp) before
its dp reduce-scatter, so an FSDP-wrapped model needs no extra step; `reduce_tp_replicated_grads`
does the same sum for a model that is not FSDP-wrapped.

Legend: S tokens of the sp shard fed to the decoder, s = S / tp tokens of a tp rank under sequence
parallelism, Hq / Hkv query / kv heads, I intermediate size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from rlsp.parallel.tp_checks import check_tp_support
from rlsp.parallel.tp_families import SEQ_DIM, LocalReplicatedMoE, qk_norm_plan, shard_sinks, sparse_moe_block
from rlsp.parallel.tp_latent import LatentAttentionParallel, latent_attention
from rlsp.parallel.tp_linear_attention import GroupShardedGatedDeltaNet
from rlsp.parallel.tp_sp import ShardedInputSaver


@dataclass(frozen=True)
class TPInfo:
    """The tp group of a head model, attached as `model.tp_info` by `apply_tensor_parallel`."""

    mesh: DeviceMesh
    size: int
    rank: int
    sequence_parallel: bool

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()

    @property
    def head_grad_placements(self) -> tuple[Placement, ...]:
        """How a head's local weight gradient relates to the full one (see the module docstring)."""
        return (Partial(),) if self.sequence_parallel else (Replicate(),)

    def local_len(self, num_tokens: int) -> int:
        """Tokens a tp rank's outputs cover for a decoder input of `num_tokens` (S/tp or S)."""
        if not self.sequence_parallel:
            return num_tokens
        if num_tokens % self.size != 0:
            raise ValueError(
                f"the decoder input has {num_tokens} tokens, not a multiple of tp={self.size} (sequence "
                f"parallel); pack the stream with pad_to_multiple=sp*tp"
            )
        return num_tokens // self.size

    def local_tokens(self, x_S: torch.Tensor) -> torch.Tensor:
        """This tp rank's tokens of a per-token tensor [S, ...]: its contiguous [S/tp] block under
        sequence parallelism (block `rank`), all of it otherwise."""
        n = self.local_len(x_S.shape[0])
        return x_S.narrow(0, self.rank * n, n) if self.sequence_parallel else x_S


class _ReplicateParallel(ParallelStyle):
    """Parameters replicated over tp (from tp rank 0); the first input is made a DTensor with layout
    `input_layout` (a plain tensor is taken as that layout) and redistributed to `desired_layout`;
    the output stays a DTensor. Used for the embedding (token ids Replicate -> this rank's token
    slice under sequence parallelism) and for the norms (in and out in the residual's layout)."""

    def __init__(self, input_layout: Placement, desired_layout: Placement) -> None:
        super().__init__()
        self.input_layout, self.desired_layout = input_layout, desired_layout

    def _replicate_params(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for p_name, param in list(module.named_parameters(recurse=False)):
            replicated = distribute_tensor(param.data, mesh, [Replicate()], src_data_rank=self.src_data_rank)
            module.register_parameter(p_name, nn.Parameter(replicated, requires_grad=param.requires_grad))

    def _prepare_input(self, module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [self.input_layout], run_check=False)
        if x.placements != (self.desired_layout,):
            x = x.redistribute(placements=[self.desired_layout])
        return (x, *inputs[1:])

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._replicate_params, self._prepare_input)


class _BlockInput(ParallelStyle):
    """Input of an attention or MLP block (`kwarg`, or the first positional input): the full token
    range, replicated over tp, as the column-parallel projections need it. From a token-sharded residual
    (sequence parallel) an all-gather, whose backward reduce-scatters the gradient, and `projections`
    save only this rank's shard for backward (rlsp.parallel.tp_sp); from a replicated residual the
    identity, whose backward all-reduces the gradient (Megatron's f operator) so that the residual
    stream's gradient stays complete on every tp rank instead of travelling on as a Partial sum. One
    collective per block and direction, shared by q/k/v (gate/up)."""

    def __init__(self, projections: tuple[str, ...], kwarg: str | None = None) -> None:
        super().__init__()
        self.projections, self.kwarg = projections, kwarg
        self.saver = ShardedInputSaver()

    def _full(self, x: Any) -> DTensor:
        if not isinstance(x, DTensor):
            raise RuntimeError(f"a tensor-parallel block expects the residual stream as a DTensor, got {type(x)}")
        if x.placements != (Replicate(),):
            full = x.redistribute(placements=[Replicate()])
            self.saver.begin(x, full)
            return full
        return DTensor.from_local(x.to_local(), x.device_mesh, [Replicate()], run_check=False)

    def _hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        if self.kwarg is None:
            return (self._full(args[0]), *args[1:]), kwargs
        if self.kwarg not in kwargs:
            raise RuntimeError(f"{type(module).__name__} was called without the keyword {self.kwarg!r}")
        return args, {**kwargs, self.kwarg: self._full(kwargs[self.kwarg])}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(self._hook, with_kwargs=True)
        module.register_forward_hook(self.saver.end, always_call=True)
        module.tp_input_saver = self.saver  # inspectable (how often backward re-gathered)
        for name in self.projections:
            self.saver.attach(module.get_submodule(name))
        return module


def _layer_plan(seq: Placement, layer: nn.Module, model_type: str) -> dict[str, ParallelStyle]:
    """TP plan of one decoder layer (Llama/Qwen2-style plus the tp_families extras); `seq`: the residual's layout."""
    plan: dict[str, ParallelStyle] = {
        "input_layernorm": _ReplicateParallel(seq, seq),
        "self_attn": _BlockInput(("q_proj", "k_proj", "v_proj"), "hidden_states"),  # HF passes it by keyword
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
        "post_attention_layernorm": _ReplicateParallel(seq, seq),
    }
    for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):  # Gemma 2 / 3: on the residual
        plan.update({norm: _ReplicateParallel(seq, seq)} if hasattr(layer, norm) else {})
    attn = getattr(layer, "self_attn", None)  # None on a Gated DeltaNet layer (linear_attn)
    plan.update(qk_norm_plan(attn, model_type))
    if latent_attention(attn, model_type):  # MLA: the whole block on local tensors (tp_latent)
        plan = {k: s for k, s in plan.items() if not k.startswith("self_attn")}
        plan["self_attn"] = LatentAttentionParallel(seq)
    if attn is None and hasattr(layer, "linear_attn"):  # Gated DeltaNet: split by key-head groups (tp_linear_attention)
        plan = {k: s for k, s in plan.items() if not k.startswith("self_attn")}
        plan["linear_attn"] = GroupShardedGatedDeltaNet(seq)
    if sparse_moe_block(layer.mlp, model_type):  # a dense layer of a MoE family keeps the plan below
        plan["mlp"] = LocalReplicatedMoE(seq, model_type)
        return plan
    return {**plan, "mlp": _BlockInput(("gate_proj", "up_proj")), "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=seq, use_local_output=False)}


def _check_layout(module: nn.Module, what: str, names: list[str]) -> None:
    modules = dict(module.named_modules())
    missing = [name for name in names if name not in modules]
    if missing:
        raise ValueError(
            f"{what} ({type(module).__name__}) lacks {missing}; tensor parallelism supports Llama/Qwen2-style "
            f"decoders with submodules {sorted(names)}"
        )


def _check_all_distributed(layer: nn.Module, index: int) -> None:
    """Every parameter of a layer must be covered by the plan (e.g. Qwen3's per-head q_norm is not)."""
    plain = [n for n, p in layer.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise ValueError(
            f"decoder layer {index} ({type(layer).__name__}) has parameters outside the tensor-parallel plan: "
            f"{plain}; supported: Llama/Qwen2-style layers (q/k/v/o and gate/up/down projections, two norms)"
        )


def _param_owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every (module, attribute) holding each parameter, so that tied parameters can be re-tied."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, name))
    return owners


def _replicate_rest(model: nn.Module, mesh: DeviceMesh, owners: dict[int, list[tuple[nn.Module, str]]]) -> None:
    """Re-tie parameters the decoder plan replaced (tied embeddings), then replicate the remaining
    plain parameters (lm_head, value head) over tp from tp rank 0, keeping ties."""
    for holders in owners.values():
        current = [getattr(m, n) for m, n in holders]
        new = next((p for p in current if isinstance(p, DTensor)), None)
        if new is None:
            old = current[0]
            new = nn.Parameter(distribute_tensor(old.data, mesh, [Replicate()]), requires_grad=old.requires_grad)
        for module, name in holders:
            if getattr(module, name) is not new:
                module.register_parameter(name, new)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Tensor-parallelise `model` (a head model exposing `decoder`) in place over the 1-D `tp_mesh`;
    call it before FSDP2. Sets `model.tp_info`. See the module docstring for the layouts."""
    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be 1-D (the tp dimension of the world mesh, e.g. mesh['tp']), got {tp_mesh}")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise RuntimeError("model already has DTensor parameters: apply tensor parallelism once, before FSDP2")
    decoder = model.decoder
    check_tp_support(decoder.config, tp_mesh.size())
    owners = _param_owners(model)
    seq: Placement = Shard(SEQ_DIM) if sequence_parallel else Replicate()
    # the embedding turns replicated token ids into the residual stream's layout (a token slice: no
    # communication); the final norm keeps it, so the decoder output is this rank's tokens
    outer = {"embed_tokens": _ReplicateParallel(Replicate(), seq), "norm": _ReplicateParallel(seq, seq)}
    _check_layout(decoder, "the decoder", [*outer, "layers"])
    for index, layer in enumerate(decoder.layers):
        plan = _layer_plan(seq, layer, decoder.config.model_type)
        _check_layout(layer, f"decoder layer {index}", list(plan))
        parallelize_module(layer, tp_mesh, plan)
        shard_sinks(getattr(layer, "self_attn", None), tp_mesh)
        _check_all_distributed(layer, index)
    parallelize_module(decoder, tp_mesh, outer)
    _replicate_rest(model, tp_mesh, owners)
    model.tp_info = TPInfo(tp_mesh, tp_mesh.size(), tp_mesh.get_local_rank(), sequence_parallel)


def tp_local_param(param: torch.Tensor, tp: TPInfo | None) -> torch.Tensor:
    """The local tensor of a tp-replicated head parameter, for use on this tp rank's tokens; its
    gradient flows back as a Partial (sequence parallel) or Replicate contribution (see TPInfo)."""
    if tp is None:
        return param
    if not isinstance(param, DTensor) or any(not p.is_replicate() for p in param.placements):
        placements = getattr(param, "placements", "none (a plain tensor)")
        raise RuntimeError(f"head parameter has placements {placements}; expected Replicate over tp "
                           "(apply_tensor_parallel replicates every parameter outside the decoder layers)")
    return param.to_local(grad_placements=tp.head_grad_placements)


def tp_local_tokens(hidden: torch.Tensor) -> torch.Tensor:
    """The decoder output as a plain tensor: this tp rank's token slice (or the full, replicated stream)."""
    return hidden.to_local() if isinstance(hidden, DTensor) else hidden


def reduce_tp_replicated_grads(model: nn.Module) -> int:
    """Sum Partial gradients of tp-replicated parameters over tp (in place); returns how many.

    Needed only for a model that is NOT FSDP-wrapped, before clipping or an optimizer step: FSDP2
    already redistributes each gradient to its parameter's placement before reducing over dp. A
    no-op without sequence parallelism (replicated gradients are complete on every tp rank).
    """
    count = 0
    for param in model.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            param.grad = grad.redistribute(placements=param.placements)
            count += 1
    return count

