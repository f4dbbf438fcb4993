"""Gated DeltaNet (linear attention) layers of Qwen3-Next / Qwen3.5 under Ulysses, exact on packed streams.

transformers' Gated DeltaNet (`Qwen3NextGatedDeltaNet`, `Qwen3_5GatedDeltaNet`) does not go through the attention
interface: it runs a causal conv1d and the chunked gated delta rule over its whole input, so on rlsp's packed
stream the conv window and the recurrent state would leak from one row into the next, and under Ulysses a rank
would see only its shard. `apply_linear_attention(model)` swaps each such module for `UlyssesGatedDeltaNet`, which
takes over the SAME parameter objects under the same names (state_dict keys, checkpoints and weight sync are
unchanged; no transformers class is patched). Its forward, given the SP context the decoder layer forwards to it
(transformers' decoder layers pass their **kwargs, `sp_context` included, to `linear_attn`):
  1. projects this rank's S tokens locally (q, k, v, b, a per key-head group; z for the gated norm),
  2. exchanges tokens <-> key-head groups in one all-to-all (rlsp.parallel.ulysses): each rank receives the whole
     stream for a contiguous range of groups (value head j reads key head j // r, so a group carries its key head
     and its r value heads; groups are split as evenly as possible, ranks beyond the group count idle),
  3. runs the causal conv1d and the gated delta rule per packed segment (cu_seqlens of the context): conv window
     and state start from zero at every row, as transformers' forward of that row alone,
  4. exchanges the core output back to [S tokens, all value heads] (one all-to-all), then the gated norm and out_proj.
Tensor parallelism (rlsp.parallel.tp_linear_attention) sets `groups`, a contiguous range of the key-head groups: the
module then projects and mixes those only (Ulysses splits them further) and returns out_proj's partial sum over their
value heads (a weight holding every group's rows is read at the range's rows; a tp shard of exactly them, as is).
Kernels: on CPU transformers' own torch functions once per segment (exact against its forward of each row). On an
accelerator the conv is one masked pass over the stream (`masked_segment_conv`, checked against the per-segment conv
on CPU), and the delta rule flash-linear-attention's varlen `chunk_gated_delta_rule` (one call for all segments) when
installed and computing in bf16/fp16, else transformers' torch function per segment. Ring attention is refused for
these layers (rlsp.models.family_checks). Each forward counts as one attention call in the context's stats.

Legend: S local tokens, T stream length, G key-head groups (= key heads), g the module's groups (all G without tp),
u a rank's groups, r value heads per key head, N value heads (G * r), n the module's value heads, K key head dim,
V value head dim, C conv channels, W packed width of one group (q K | k K | v r*V | b r | a r), H hidden size.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn, torch_chunk_gated_delta_rule

from rlsp.parallel.heads import plan_head_layout
from rlsp.parallel.ulysses import SPContext, all_to_all_flat

try:  # optional varlen kernel on GPU
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_rule
except ImportError:  # pragma: no cover - depends on the installation
    _fla_rule = None

LINEAR_LAYER_TYPE = "linear_attention"
# Families whose Gated DeltaNet layers this module reproduces (projection layouts: fused qkvz/ba or separate).
LINEAR_FAMILIES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
_SHAPE_ATTRS = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim",
                "conv_kernel_size", "activation", "layer_idx")


def has_linear_layers(config: Any) -> bool:
    """True when `config.layer_types` names Gated DeltaNet (linear_attention) layers."""
    return LINEAR_LAYER_TYPE in (getattr(config, "layer_types", None) or ())


class UlyssesGatedDeltaNet(nn.Module):
    """A transformers Gated DeltaNet's parameters (same objects, same names) run per packed segment under Ulysses."""

    def __init__(self, source: nn.Module) -> None:
        super().__init__()
        missing = [a for a in (*_SHAPE_ATTRS, "conv1d", "A_log", "dt_bias", "norm", "out_proj") if not hasattr(source, a)]
        self.fused = hasattr(source, "in_proj_qkvz")  # Qwen3-Next: per-group interleaved qkvz and ba projections
        if missing or not (self.fused or hasattr(source, "in_proj_qkv")):
            raise ValueError(f"{type(source).__name__} is not a Gated DeltaNet rlsp knows (missing {missing or 'in_proj'});"
                             f" supported: the linear_attention layers of {list(LINEAR_FAMILIES)}")
        for name in _SHAPE_ATTRS:
            setattr(self, name, getattr(source, name))
        self.ratio = self.num_v_heads // self.num_k_heads
        if self.ratio * self.num_k_heads != self.num_v_heads:
            raise ValueError(f"linear_num_value_heads={self.num_v_heads} is not a multiple of "
                             f"linear_num_key_heads={self.num_k_heads}")
        # parameters first, then children, each in the source's order: the same state_dict keys in the same order
        for name, param in source.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, child in source.named_children():
            self.add_module(name, child)
        self.groups = (0, self.num_k_heads)  # the key-head groups this module computes (tp: a contiguous range)

    def _project(self, h_SH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token: (x_SgW packed per key-head group of `groups`, z_SnV the gate of the norm)."""
        S, K, V, r, kd, vd = h_SH.shape[0], self.head_k_dim, self.head_v_dim, self.ratio, self.key_dim, self.value_dim
        (g0, g1), G = self.groups, self.num_k_heads
        if self.fused:
            w = 2 * K + 2 * r * V
            qkvz_SgX = _part_linear(self.in_proj_qkvz, h_SH, [(g0 * w, g1 * w)], G * w).view(S, g1 - g0, w)
            q, k, v, z = qkvz_SgX.split([K, K, r * V, r * V], dim=-1)
            ba = _part_linear(self.in_proj_ba, h_SH, [(g0 * 2 * r, g1 * 2 * r)], G * 2 * r)
            b, a = ba.view(S, g1 - g0, 2 * r).split([r, r], dim=-1)
        else:  # [q all heads | k all heads | v all heads]: this range's rows of each block
            blocks = self._qkv_rows(g0, g1)
            qkv_SX = _part_linear(self.in_proj_qkv, h_SH, blocks, 2 * kd + vd)
            q, k, v = (t.view(S, g1 - g0, -1) for t in qkv_SX.split([e - s for s, e in blocks], dim=-1))
            z = _part_linear(self.in_proj_z, h_SH, [(g0 * r * V, g1 * r * V)], vd)
            b = _part_linear(self.in_proj_b, h_SH, [(g0 * r, g1 * r)], G * r).view(S, g1 - g0, r)
            a = _part_linear(self.in_proj_a, h_SH, [(g0 * r, g1 * r)], G * r).view(S, g1 - g0, r)
        return torch.cat([q, k, v, b, a], dim=-1), z.reshape(S, (g1 - g0) * r, V)

    def _qkv_rows(self, g0: int, g1: int) -> list[tuple[int, int]]:
        """The q, k and v channel ranges of groups [g0, g1) in the layout [q all heads | k all heads | v all heads]."""
        K, rV, kd = self.head_k_dim, self.ratio * self.head_v_dim, self.key_dim
        return [(g0 * K, g1 * K), (kd + g0 * K, kd + g1 * K), (2 * kd + g0 * rV, 2 * kd + g1 * rV)]

    def _mix(self, x_TgW: torch.Tensor, g0: int, g1: int, ctx: SPContext) -> torch.Tensor:
        """Conv + gated delta rule of groups [g0, g1) over the whole stream, per segment -> core_TnV."""
        T, g, K, V, r = x_TgW.shape[0], g1 - g0, self.head_k_dim, self.head_v_dim, self.ratio
        if g == 0:  # an idle rank: its backward must still join the all-to-alls, and FSDP's gradient reduction
            # needs a (zero) gradient for every parameter, the conv and decay ones included
            touched = x_TgW.sum() + self.conv1d.weight.sum() + self.A_log.sum() + self.dt_bias.sum()
            return x_TgW.new_zeros(T, 0, V) + 0 * touched
        q, k, v, b, a = x_TgW.split([K, K, r * V, r, r], dim=-1)
        x_TC = torch.cat([q.reshape(T, g * K), k.reshape(T, g * K), v.reshape(T, g * r * V)], dim=-1)
        idx = torch.cat([torch.arange(s, e) for s, e in self._qkv_rows(g0, g1)]).to(x_TC.device)  # conv channels
        bias = None if self.conv1d.bias is None else self.conv1d.bias.index_select(0, idx)
        y_TC = _segment_conv(x_TC, self.conv1d.weight.squeeze(1).index_select(0, idx), bias, self.activation, ctx)
        q, k, v = y_TC.split([g * K, g * K, g * r * V], dim=-1)
        vh = slice(g0 * r, g1 * r)
        beta_Tn = b.reshape(T, g * r).sigmoid()
        decay_Tn = -self.A_log[vh].float().exp() * F.softplus(a.reshape(T, g * r).float() + self.dt_bias[vh])
        q_TnK = q.reshape(T, g, K).repeat_interleave(r, dim=1)
        k_TnK = k.reshape(T, g, K).repeat_interleave(r, dim=1)
        return _segment_delta_rule(q_TnK, k_TnK, v.reshape(T, g * r, V), decay_Tn, beta_Tn, ctx)

    def forward(self, hidden_states: torch.Tensor, cache_params: Any = None, attention_mask: Any = None,
                sp_context: SPContext | None = None, **kwargs: Any) -> torch.Tensor:
        """[1, S, H] -> [1, S, H] (tp: out_proj's partial sum over `groups`); `attention_mask` is ignored."""
        ctx = _check_call(hidden_states, cache_params, sp_context)
        x_SgW, z_SnV = self._project(hidden_states[0])
        (g0, g1), r, V = self.groups, self.ratio, self.head_v_dim
        (u0, u1), ranges = _group_ranges(g1 - g0, ctx)
        core_TuV = self._mix(_groups_to_heads(x_SgW, ranges, ctx), g0 + u0, g0 + u1, ctx)
        core_SnV = _heads_to_groups(core_TuV, [(s * r, e * r) for s, e in ranges], ctx)
        out_Sn = self.norm(core_SnV.reshape(-1, V), z_SnV.reshape(-1, V)).reshape(core_SnV.shape[0], -1)
        ctx.stats.attn_calls += 1
        return _part_linear(self.out_proj, out_Sn, [(g0 * r * V, g1 * r * V)], self.value_dim, dim=1).unsqueeze(0)


def _part_linear(linear: nn.Module, x: torch.Tensor, blocks: list[tuple[int, int]], full: int,
                 dim: int = 0) -> torch.Tensor:
    """`linear` on the output rows (dim 0) or input columns (dim 1: a partial sum) `blocks` of its weight: the module
    itself when they span all its `full` rows / columns; else without a bias (rlsp.parallel.tp_linear_attention refuses
    one), a weight of exactly those rows / columns (a tp shard) used as is."""
    if blocks == [(0, full)]:
        return linear(x)
    w = linear.weight
    return F.linear(x, w if w.shape[dim] != full else torch.cat([w.narrow(dim, s, e - s) for s, e in blocks], dim))


def _check_call(hidden_states: torch.Tensor, cache_params: Any, sp_context: Any) -> SPContext:
    if not isinstance(sp_context, SPContext):
        raise RuntimeError(f"UlyssesGatedDeltaNet needs the forward kwarg sp_context=SPContext (got "
                           f"{type(sp_context).__name__}); call model(input_ids=..., position_ids=..., sp_context=ctx),"
                           " or load without attn_implementation='rlsp_ulysses' for generation (rollout.name=hf does)")
    if cache_params is not None:
        raise RuntimeError("UlyssesGatedDeltaNet trains on packed streams without a cache; pass use_cache=False")
    if sp_context.ring_size > 1:
        raise ValueError(f"ring_sequence_parallel_size={sp_context.ring_size}: Gated DeltaNet (linear_attention) "
                         "layers are not run by ring attention; legal: 1 (Ulysses alone runs them exactly)")
    if hidden_states.dim() != 3 or hidden_states.shape[0] != 1 or hidden_states.shape[1] != sp_context.local_len:
        raise ValueError(f"hidden_states has shape {tuple(hidden_states.shape)}; expected [1, S={sp_context.local_len},"
                         " H] (this rank's shard of one packed stream)")
    return sp_context


def _group_ranges(num_groups: int, ctx: SPContext) -> tuple[tuple[int, int], list[tuple[int, int]]]:
    """(this rank's key-head group range, every rank's), contiguous and as even as possible."""
    key = ("linear_groups", num_groups)
    if key not in ctx.cache:
        ctx.cache[key] = list(plan_head_layout(num_groups, num_groups, ctx.ulysses_size).q_ranges)
    ranges = ctx.cache[key]
    return ranges[ctx.ulysses_rank], ranges


def _groups_to_heads(x_SGW: torch.Tensor, ranges: list[tuple[int, int]], ctx: SPContext) -> torch.Tensor:
    """[S tokens, all groups] -> [T tokens, this rank's groups] in one all-to-all."""
    if ctx.ulysses_size == 1:
        return x_SGW
    S, W = x_SGW.shape[0], x_SGW.shape[2]
    g0, g1 = ranges[ctx.ulysses_rank]
    send = torch.cat([x_SGW[:, s:e].reshape(-1) for s, e in ranges])
    recv = all_to_all_flat(send, [S * (e - s) * W for s, e in ranges], [S * (g1 - g0) * W] * ctx.ulysses_size, ctx)
    # sources are in token order: source p sent its S tokens of my groups
    return recv.view(ctx.total_len, g1 - g0, W)


def _heads_to_groups(o_TnV: torch.Tensor, v_ranges: list[tuple[int, int]], ctx: SPContext) -> torch.Tensor:
    """[T tokens, this rank's value heads] -> [S tokens, all value heads] in one all-to-all."""
    if ctx.ulysses_size == 1:
        return o_TnV
    S, n, V = ctx.local_len, o_TnV.shape[1], o_TnV.shape[2]
    counts = [e - s for s, e in v_ranges]
    recv_splits = [S * c * V for c in counts]
    recv = all_to_all_flat(o_TnV.reshape(-1), [S * n * V] * ctx.ulysses_size, recv_splits, ctx)
    return torch.cat([p.view(S, c, V) for p, c in zip(recv.split(recv_splits), counts)], dim=1)


def _segments(ctx: SPContext) -> list[tuple[int, int]]:
    if "linear_segments" not in ctx.cache:
        cu = ctx.cu_seqlens.tolist()
        ctx.cache["linear_segments"] = [(s, e) for s, e in zip(cu[:-1], cu[1:]) if e > s]
    return ctx.cache["linear_segments"]


def _use_fla(x: torch.Tensor) -> bool:
    # fla's chunked kernel runs in half precision only (it asserts q is not float32)
    return (_fla_rule is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and fla_trains_on(x.device.index if x.device.index is not None else torch.cuda.current_device()))


@functools.cache
def fla_trains_on(device_index: int) -> bool:
    """Whether fla's gated delta rule can run forward AND backward on CUDA device `device_index`: fla refuses the
    gated backward on Hopper (compute capability 9.x) with Triton >= 3.4.0 and < 3.7.1 (wrong gradients there)
    unless tilelang is installed. Where it cannot, every pass takes the torch path (one kernel for the old-logprob
    pass and the update, so their logprobs agree), with one warning."""
    major, _ = torch.cuda.get_device_capability(device_index)
    if major != 9 or importlib.util.find_spec("tilelang") is not None:
        return True
    try:
        import triton
    except ImportError:  # pragma: no cover - fla needs triton; without it fla is not importable either
        return False
    version = tuple(int(p) for p in re.findall(r"\d+", triton.__version__)[:3])
    if (3, 4, 0) <= version < (3, 7, 1):
        warnings.warn(f"Gated DeltaNet: flash-linear-attention's backward is wrong on Hopper with Triton "
                      f"{triton.__version__} (>= 3.4.0, < 3.7.1), fla refuses it; rlsp uses its torch path on device "
                      f"{device_index} (exact, slower). Triton >= 3.7.1 or tilelang brings fla back.", stacklevel=2)
        return False
    return True


def _positions_in_segment(ctx: SPContext, device: torch.device) -> torch.Tensor:
    """[T] offset of every stream token from the start of its segment."""
    key = ("linear_positions", str(device))
    if key not in ctx.cache:
        cu = ctx.cu_seqlens.to(device=device, dtype=torch.long)
        starts_T = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
        ctx.cache[key] = torch.arange(ctx.total_len, device=device) - starts_T
    return ctx.cache[key]


def masked_segment_conv(x_TC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None,
                        ctx: SPContext) -> torch.Tensor:
    """Causal depthwise conv over the whole stream in one pass (no activation): tap j reads token t - j only when
    it lies in t's segment, i.e. every segment starts from zero padding; [T, C] -> [T, C]."""
    pos_T1 = _positions_in_segment(ctx, x_TC.device).unsqueeze(1)
    width = weight_CK.shape[1]
    out_TC = x_TC * weight_CK[:, width - 1]
    for j in range(1, width):
        shifted_TC = F.pad(x_TC[:-j], (0, 0, j, 0)).masked_fill(pos_T1 < j, 0.0)
        out_TC = out_TC + shifted_TC * weight_CK[:, width - 1 - j]
    return out_TC if bias_C is None else out_TC + bias_C


def _segment_conv(x_TC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None, activation: str,
                  ctx: SPContext) -> torch.Tensor:
    """Causal depthwise conv1d + activation restarting from zeros at every segment: [T, C] -> [T, C]. On CPU
    transformers' own function per segment (exact against its forward of each row); elsewhere one masked pass."""
    if x_TC.device.type != "cpu":
        y_TC = masked_segment_conv(x_TC.to(weight_CK.dtype), weight_CK, bias_C, ctx)
        return ACT2FN[activation](y_TC).to(x_TC.dtype)
    parts = [causal_conv1d_fn(x_TC[s:e].t().unsqueeze(0), weight_CK, bias_C, activation=activation)[0].t()
             for s, e in _segments(ctx)]
    return torch.cat(parts, dim=0)


def _segment_delta_rule(q_TnK: torch.Tensor, k_TnK: torch.Tensor, v_TnV: torch.Tensor, decay_Tn: torch.Tensor,
                        beta_Tn: torch.Tensor, ctx: SPContext) -> torch.Tensor:
    """Chunked gated delta rule (q/k l2-normalised in the kernel) from a zero state at every segment -> [T, n, V]."""
    if _use_fla(q_TnK):
        cu = ctx.cu_seqlens.to(device=q_TnK.device, dtype=torch.long)
        out_1TnV, _ = _fla_rule(q_TnK[None], k_TnK[None], v_TnV[None], g=decay_Tn[None], beta=beta_Tn[None],
                                initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True,
                                cu_seqlens=cu)
        return out_1TnV[0]
    return torch.cat([torch_chunk_gated_delta_rule(q_TnK[None, s:e], k_TnK[None, s:e], v_TnV[None, s:e],
                                                   g=decay_Tn[None, s:e], beta=beta_Tn[None, s:e], initial_state=None,
                                                   output_final_state=False, use_qk_l2norm_in_kernel=True)[0][0]
                      for s, e in _segments(ctx)], dim=0)


def apply_linear_attention(model: nn.Module) -> int:
    """Swap every transformers Gated DeltaNet (`<layer>.linear_attn`) of `model` for `UlyssesGatedDeltaNet` in place,
    keeping its parameters; returns how many were swapped (0 for models without linear_attention layers)."""
    swapped = 0
    for module in list(model.modules()):
        child = getattr(module, "linear_attn", None)
        if isinstance(child, nn.Module) and not isinstance(child, UlyssesGatedDeltaNet):
            module.linear_attn = UlyssesGatedDeltaNet(child)
            swapped += 1
    return swapped
