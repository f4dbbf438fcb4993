"""Tiled MLP: each decoder layer's MLP runs over token tiles, so its [tokens, intermediate]
activations exist for one tile at a time (the ALST / DeepSpeed TiledMLP idea).

`apply_tiled_mlp(decoder, num_shards)` replaces every `layer.mlp` of a HF decoder by a `TiledMLP`
that takes over the MLP's child modules under the same names, so every parameter keeps its HF name
(`model.layers.0.mlp.gate_proj.weight`): weight sync, checkpoints and export see no difference.
Apply it before tensor parallelism and FSDP2, as the roles do when they build a model.

How it runs (`_TiledMLPFunction`): the forward computes the MLP tile by tile without recording a
graph and saves only the MLP input; the backward recomputes one tile at a time with autograd on,
back-propagates the tile's output gradient and sums the parameter gradients over the tiles, which
it returns like any autograd function (autograd accumulates them into `.grad`). The MLP therefore
runs twice per training step (three times under gradient checkpointing), and the MLP's share of a
layer's activations falls from about four [N, I] tensors to four [N/n, I] (plus the saved [N, H]
input). Parameters are read from the module both times: under FSDP2 they are the unsharded
parameters the layer's pre-forward hook gathered, and in backward the ones its pre-backward hook
gathered again (the same mechanism non-reentrant activation checkpointing relies on when it
recomputes a layer in backward); the gradients reach those unsharded parameters before FSDP's
post-backward reduce-scatter reads them. Parameter gradients are summed in the parameter dtype.

Exact: a per-token MLP applied to row blocks gives the same values, and the summed per-tile
gradients equal the full ones up to the order of floating-point additions (tests check fp32 and
fp64). Under tensor parallelism the row-parallel down projection would reduce (and, with
sequence-parallel activations, scatter) every tile separately over the tp group, so configuration
validation refuses tiled MLP with tensor_model_parallel_size > 1 and `TiledMLP` refuses DTensors.

Legend: N tokens (all leading dims flattened), H hidden size, I intermediate size, n tiles.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

# The gated MLP of Llama / Qwen2 / Mistral-style decoders: down(act(gate(x)) * up(x)).
GATED_MLP_CHILDREN = ("gate_proj", "up_proj", "down_proj", "act_fn")


def check_num_shards(num_shards: Any) -> None:
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"tiled_mlp.num_shards={num_shards!r} must be an integer >= 1 (tiles per MLP call; "
                         "1 = one tile, still recomputed in backward)")


def _tiles(x_N: torch.Tensor, num_shards: int) -> tuple[torch.Tensor, ...]:
    """At most `num_shards` contiguous row blocks of near-equal size (never an empty one)."""
    return x_N.tensor_split(max(1, min(num_shards, x_N.shape[0])), dim=0)


class _TiledMLPFunction(torch.autograd.Function):
    """out = module.mlp_forward(x) tile by tile; `params` are the module's parameters (listed so that
    autograd routes their gradients; the module reads its own attributes when it runs)."""

    @staticmethod
    def forward(ctx: Any, module: TiledMLP, x_NH: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.module = module
        ctx.save_for_backward(x_NH)
        tiles = _tiles(x_NH, module.num_shards)
        with torch.no_grad():
            first = module.mlp_forward(tiles[0])
            out_NH = first.new_empty((x_NH.shape[0], first.shape[-1]))
            out_NH[: first.shape[0]] = first
            start = first.shape[0]
            for tile in tiles[1:]:
                out_NH[start : start + tile.shape[0]] = module.mlp_forward(tile)
                start += tile.shape[0]
        return out_NH

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_NH: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x_NH,) = ctx.saved_tensors
        module: TiledMLP = ctx.module
        need_x, need_p = ctx.needs_input_grad[1], ctx.needs_input_grad[2:]
        trained = [p for p, need in zip(module.parameters(), need_p) if need]
        grad_x = torch.empty_like(x_NH) if need_x else None
        sums: list[torch.Tensor | None] = [None] * len(trained)
        start = 0
        for tile, grad_tile in zip(_tiles(x_NH, module.num_shards), _tiles(grad_NH, module.num_shards)):
            with torch.enable_grad():
                tile = tile.detach().requires_grad_(need_x)
                inputs = [tile] * need_x + trained
                grads = torch.autograd.grad(module.mlp_forward(tile), inputs, grad_tile, allow_unused=True)
            if need_x:
                grad_x[start : start + tile.shape[0]] = grads[0]
            for i, g in enumerate(grads[need_x:]):
                sums[i] = g if sums[i] is None else (sums[i] if g is None else sums[i].add_(g))
            start += tile.shape[0]
        it = iter(sums)
        return (None, grad_x, *(next(it) if need else None for need in need_p))


class TiledMLP(nn.Module):
    """The gated MLP `mlp` (its children, under the same names) run over `num_shards` token tiles."""

    def __init__(self, mlp: nn.Module, num_shards: int) -> None:
        super().__init__()
        check_num_shards(num_shards)
        for name in GATED_MLP_CHILDREN:
            self.add_module(name, getattr(mlp, name))
        self.num_shards = num_shards

    def mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The untiled MLP on a block of tokens."""
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor):
            raise RuntimeError(
                "tiled MLP got a DTensor input (tensor parallelism); it runs on plain tensors only: set "
                "tiled_mlp.enabled=false or tensor_model_parallel_size=1"
            )
        out_NH = _TiledMLPFunction.apply(self, x.reshape(-1, x.shape[-1]), *self.parameters())
        return out_NH.view(*x.shape[:-1], out_NH.shape[-1])

    def extra_repr(self) -> str:
        return f"num_shards={self.num_shards}"


def _check_gated_mlp(mlp: nn.Module, index: int, family: str) -> None:
    """`mlp` must be exactly a gated MLP: those children, no tensors of its own (an MoE block is refused,
    naming the model family; rlsp.models.feature_support refuses it before workers start)."""
    children = sorted(name for name, _ in mlp.named_children())
    own = [n for n, _ in [*mlp.named_parameters(recurse=False), *mlp.named_buffers(recurse=False)]]
    if children != sorted(GATED_MLP_CHILDREN) or own:
        raise ValueError(
            f"{family}: decoder layer {index}: mlp {type(mlp).__name__} has children {children} and own tensors {own}; "
            f"tiled MLP supports gated MLPs with exactly the children {list(GATED_MLP_CHILDREN)} "
            "(Llama / Qwen2 / Mistral / Gemma-style; not an MoE block): set tiled_mlp.enabled=false for this model"
        )


def _check_same_function(mlp: nn.Module, tiled: TiledMLP, index: int) -> None:
    """The model's own MLP and the tiled one must compute the same function (on two random tokens)."""
    weight = tiled.gate_proj.weight
    if weight.device.type == "meta":
        return
    g = torch.Generator().manual_seed(index)
    x = torch.randn(2, weight.shape[1], generator=g).to(weight.device, weight.dtype)
    with torch.no_grad():
        ours, theirs = tiled(x), mlp(x)
    try:
        torch.testing.assert_close(ours, theirs)
    except AssertionError as err:
        raise ValueError(f"decoder layer {index}: {type(mlp).__name__} is not down(act(gate(x)) * up(x)); tiled MLP "
                         f"does not support it (set tiled_mlp.enabled=false): {err}") from None


def apply_tiled_mlp(decoder: nn.Module, num_shards: int) -> None:
    """Replace the MLP of every layer of `decoder` (a HF base model with `layers`) by a `TiledMLP`
    over `num_shards` tiles, in place; parameter names and values are unchanged."""
    check_num_shards(num_shards)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"{type(decoder).__name__} has no `layers`; tiled MLP needs a HF decoder (model.model)")
    family = getattr(getattr(decoder, "config", None), "model_type", type(decoder).__name__)
    for index, layer in enumerate(layers):
        mlp = layer.mlp
        if isinstance(mlp, TiledMLP):
            raise RuntimeError(f"decoder layer {index}: the MLP is already tiled; apply tiled MLP once")
        _check_gated_mlp(mlp, index, family)
        tiled = TiledMLP(mlp, num_shards)
        _check_same_function(mlp, tiled, index)
        layer.mlp = tiled
