"""MoE route capture in the hf rollout engine, for routing replay R3 (rlsp.engine.router_replay): the top-k experts
each router chose for every prompt token (prefill) and every generated token (each decode step), per sample.

A forward hook on every router module keeps the top-k expert indices of the tokens of the current forward while
`capturing()` is open. The routers are found by the function the engine is given (rlsp.engine.moe_load.find_routers,
passed in because rlsp.rollout does not import rlsp.engine), so the layers come in the order the trainer's
RouterReplay records them. `wrap(forward)` stacks each forward's indices into [N, T, L, K]; `per_sample` cuts each
sample's tokens out of them: the prompt's real tokens (left padding left out), then the response's tokens up to its
stop (the decoding loop feeds finished rows on; those tokens are not the sample's). Each sample's routes are
[prompt tokens + response tokens, L, K] int16, the layout of RouterReplay (rows: rlsp.workers.rollout_rows).

The last sampled token is never an input of the decoding loop: the engine runs one more forward for it, so every
token of the row has the route the rollout's weights give it (its own logits predict nothing that is trained).

Legend: N rows, P padded prompt width, R generated tokens, T tokens of one forward, L MoE layers, K experts per token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

import torch
from torch import nn

from rlsp.rollout.base import RolloutOutput

ROUTE_DTYPE = torch.int16  # expert indices (< 2^15), as RouterReplay keeps them
RouterFinder = Callable[[nn.Module], dict[str, nn.Module]]  # a model -> its router modules by name, in layer order


@dataclass
class RoutedOutput(RolloutOutput):
    """A RolloutOutput with each sample's routes [prompt tokens + response tokens, L, K] (ROUTE_DTYPE, on the CPU)."""

    routes: list[torch.Tensor] = field(default_factory=list)


class RouteCapture:
    """Forward hooks on a MoE model's routers that keep the routes of the decoding loop's forwards."""

    def __init__(self, model: nn.Module, find_routers: RouterFinder, model_type: str = "") -> None:
        routers = list(find_routers(model).values())
        if not routers:
            raise ValueError(f"routing replay R3 records the rollout's MoE routes; model_type={model_type!r} has no "
                             "router (a dense model); set actor_rollout_ref.actor.router_replay.mode=disabled")
        self.layers, self.top_k = len(routers), int(routers[0].top_k)
        self._layer: list[torch.Tensor | None] = [None] * self.layers
        self._forwards: list[torch.Tensor] = []
        self._on = False
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _hook(self, layer: int):
        def keep(module: nn.Module, args, output) -> None:
            if self._on:  # the routers return (logits, weights, top-k indices [tokens, K])
                self._layer[layer] = output[-1].detach().reshape(-1, self.top_k).to(ROUTE_DTYPE)
        return keep

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """Keep the routes of the forwards `wrap`ped inside (one generate call)."""
        self._forwards, self._layer, self._on = [], [None] * self.layers, True
        try:
            yield
        finally:
            self._on = False

    def wrap(self, forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """`forward(ids [N, T], ...)` that also stacks the routes of its T tokens per row."""
        def routed(ids_NT: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            logits = forward(ids_NT, *args, **kwargs)
            if self._on:
                self._stack(*ids_NT.shape)
            return logits
        return routed

    def _stack(self, n: int, t: int) -> None:
        missing = [i for i, idx in enumerate(self._layer) if idx is None or idx.shape[0] != n * t]
        if missing:
            raise RuntimeError(f"route capture: MoE layer {missing[0]} recorded no routes for the {n} x {t} tokens of "
                               "this forward (a decoding path that does not run the model's routers)")
        self._forwards.append(torch.stack(self._layer, dim=1).view(n, t, self.layers, self.top_k))
        self._layer = [None] * self.layers

    def per_sample(self, out: RolloutOutput, mask_NP: torch.Tensor) -> RoutedOutput:
        """`out` with each sample's routes: its real prompt tokens (`mask_NP`, the rows' left-padded prompt mask),
        then its response tokens (the first len(response) decode forwards: the prefill predicts the first token)."""
        if not self._forwards:
            raise RuntimeError("route capture: no forward was captured (call generate inside capturing())")
        prefill_NPLK = self._forwards[0].cpu()
        decode_NRLK = torch.cat(self._forwards[1:], dim=1).cpu() if len(self._forwards) > 1 else prefill_NPLK[:, :0]
        mask_NP = mask_NP.bool().cpu()
        routed = RoutedOutput(**{f.name: getattr(out, f.name) for f in fields(out)})
        for row, ids in enumerate(out.response_ids):
            if len(ids) > decode_NRLK.shape[1]:
                raise RuntimeError(f"route capture: sample {row} has {len(ids)} tokens, {decode_NRLK.shape[1]} were routed")
            routed.routes.append(torch.cat([prefill_NPLK[row, mask_NP[row]], decode_NRLK[row, : len(ids)]]))
        return routed
