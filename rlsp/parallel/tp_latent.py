"""Tensor parallelism for multi-latent attention (MLA: deepseek_v2, deepseek_v3), exact against one process.

An MLA block projects its input x [S, h] to two latents every head reads: q's (q_a_proj -> q_a_layernorm, rank
q_lora_rank; absent when q_lora_rank is None: q_proj reads x directly) and kv's (kv_a_proj_with_mqa -> a
kv_lora_rank part through kv_a_layernorm, and k_rot, one rotary key of qk_rope_head_dim shared by all heads). Per
head, q_b_proj (or q_proj) and kv_b_proj expand them into q, k_nope and v; o_proj mixes the heads back into h.

`LatentAttentionParallel`, applied at a layer's `self_attn`, splits the heads over tp like Megatron's attention:
  - q_b_proj (q_proj) and kv_b_proj hold this rank's Hq/tp heads' rows (Shard(0): the projections are head-major),
    o_proj their columns (Shard(1)); their weight gradients cover every token: complete for the shard;
  - the latent projections and norms are replicated over tp: every rank computes the same latents on all S tokens.
The latents feed head-sharded consumers only, so on a tp rank their gradient is the share of its heads; so is
the block input's (x reaches the heads through the latents, k_rot and q_proj alike). A column-parallel style whose
backward all-reduces its own input gradient would count that share twice beside a latent path declared partial,
so the whole block runs once on plain local tensors (torch.func.functional_call with each parameter's local
tensor) under one convention: the latent weights' gradients and the block input's are Partial over tp, summed
once (FSDP2 or `reduce_tp_replicated_grads` for the weights; the input's by the collective that made it: an
all-reduce of the replicated residual's gradient, Megatron's f, or the reduce-scatter that is the backward of
the sequence-parallel all-gather). o_proj's partial output [1, S, h] becomes the residual's layout: all-reduce,
or reduce-scatter to this rank's [S/tp] tokens under sequence parallelism; its bias (attention_bias) is added
by tp rank 0 alone, so the sum carries it once and its gradient is that rank's (Partial).
Attention (rlsp_ulysses) sees q/k/v with Hq/tp heads (rlsp.parallel.tp_checks.local_head_counts). Under
sequence parallelism the projections that read the gathered input [S, h] (q_a_proj or q_proj, kv_a_proj_with_mqa)
save only this rank's shard [S/tp, h] for their weight gradients and backward all-gathers it again, once per block
call, as the attention and MLP blocks do (rlsp.parallel.tp_sp; the block's `tp_input_saver`).

Legend: S tokens of the sp shard fed to the decoder, h hidden size, Hq q heads (= kv heads after the expansion).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Shard, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle

from rlsp.config.layer_kinds import MLA_TYPES
from rlsp.parallel.tp_families import replicate_params
from rlsp.parallel.tp_local import partial_grad_input, route_dtensor_calls
from rlsp.parallel.tp_sp import ShardedInputSaver

# the head-split projections (by heads: q_b_proj / q_proj and kv_b_proj's output rows, o_proj's input columns)
HEAD_SPLIT = {"q_proj": 0, "q_b_proj": 0, "kv_b_proj": 0, "o_proj": 1}
# the latent projections and norms every head reads: replicated over tp
LATENT = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")
# the projections that read the block input itself (q_a_proj with a q latent, q_proj without one)
READ_INPUT = ("q_a_proj", "q_proj", "kv_a_proj_with_mqa")


def latent_attention(attn: nn.Module | None, model_type: str) -> bool:
    """True for the multi-latent attention block of a deepseek_v2 / deepseek_v3 layer (it has kv_b_proj)."""
    return model_type in MLA_TYPES and isinstance(getattr(attn, "kv_b_proj", None), nn.Linear)


def _split_heads(attn: nn.Module, mesh: DeviceMesh) -> None:
    """Shard the head-split projections' weights over tp; ValueError when tp does not divide the heads."""
    heads, tp = attn.num_heads, mesh.size()
    if heads % tp:
        raise ValueError(f"tensor_model_parallel_size={tp} does not divide the {heads} heads of multi-latent "
                         f"attention layer {attn.layer_idx}; legal: the divisors of {heads}")
    for name, dim in HEAD_SPLIT.items():
        linear = getattr(attn, name, None)
        if linear is None:  # q_proj without q_lora_rank, q_b_proj with it
            continue
        if name != "o_proj" and linear.bias is not None:
            raise ValueError(f"{type(attn).__name__}.{name} has a bias; the multi-latent tp plan splits bias-free "
                             "head projections only (transformers' deepseek_v2 / deepseek_v3)")
        sharded = distribute_tensor(linear.weight.data, mesh, [Shard(dim)])
        linear.register_parameter("weight", nn.Parameter(sharded, requires_grad=linear.weight.requires_grad))


def _local_param(name: str, param: DTensor) -> torch.Tensor:
    """A parameter's local tensor for the block's local run: a head shard's gradient is complete for the shard,
    a replicated one's is this rank's heads' share (Partial); o_proj's bias counts on tp rank 0 only."""
    if any(p.is_shard() for p in param.placements):
        return param.to_local()
    local = param.to_local(grad_placements=(Partial(),))
    if name == "o_proj.bias":  # summed over tp with the partial outputs: added once, by rank 0
        return local * float(param.device_mesh.get_local_rank() == 0)
    return local


class LatentAttentionParallel(ParallelStyle):
    """Multi-latent attention over tp (see the module docstring); `seq`: the residual stream's layout
    (Shard(1): sequence parallel, Replicate otherwise). The block's output is a DTensor in that layout."""

    def __init__(self, seq: Placement) -> None:
        super().__init__()
        self.seq = seq

    def _run(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[DTensor, Any]:
        by_key = "hidden_states" in kwargs
        hidden = kwargs["hidden_states"] if by_key else args[0]
        saver = module.tp_input_saver
        x_1Sh = partial_grad_input(hidden, saver)
        if by_key:
            args, kwargs = args, {**kwargs, "hidden_states": x_1Sh}
        else:
            args = (x_1Sh, *args[1:])
        local = {n: _local_param(n, p) for n, p in module.named_parameters()}
        try:
            partial_1Sh, weights = torch.func.functional_call(module, local, args, kwargs)
        finally:
            saver.end()
        partial = DTensor.from_local(partial_1Sh, hidden.device_mesh, [Partial()], run_check=False)
        return partial.redistribute(placements=[self.seq]), weights

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not latent_attention(module, getattr(module.config, "model_type", "")):
            raise ValueError(f"{type(module).__name__} is not a deepseek_v2 / deepseek_v3 multi-latent attention "
                             f"block (kv_b_proj, model types {list(MLA_TYPES)}); LatentAttentionParallel splits only those")
        _split_heads(module, device_mesh)
        for sub in module.modules():  # the latent projections and norms, o_proj's bias
            replicate_params(sub, device_mesh)
        module.tp_input_saver = ShardedInputSaver()  # inspectable (how often backward re-gathered)
        for name in READ_INPUT:
            if getattr(module, name, None) is not None:
                module.tp_input_saver.attach(getattr(module, name))
        route_dtensor_calls(module, lambda args, kwargs: self._run(module, args, kwargs))
        return module
