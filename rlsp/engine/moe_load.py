"""Per-layer expert load of a mixture-of-experts model: how many tokens each layer's router sends to each expert.

`ExpertLoad(model)` registers a forward hook on every router module of a transformers MoE model: the class its
`_can_record_outputs["router_logits"]` names (Qwen2MoeTopKRouter, Qwen3MoeTopKRouter, MixtralTopKRouter,
OlmoeTopKRouter, Glm4MoeTopkRouter, GptOssTopKRouter, ...). Those routers return (router_logits, scores,
top-k indices); the hook counts the indices of the real tokens of the micro-batch (`recording(micro)`, the
stream's padding tail left out) and only inside that context, so a gradient-checkpointed layer's recomputation in
backward counts nothing. A router that returns no indices counts nothing, and layers without a count are left
out of the metrics (every family rlsp accepts returns them: qwen2_moe, qwen3_moe, mixtral, olmoe, glm4_moe,
deepseek_v3's grouped top-k router, gpt_oss). Dense models have no
router: `enabled` is False and `reduce` reports nothing.

`reduce` sums the counts over every rank of the world (collective): each rank routes its own shard of the stream
(dp rows, Ulysses / ring sequence shards), so every token is counted once; ranks that hold the same tokens (tp)
scale every count alike, which the reported ratios do not see.

Legend: S local tokens, K experts per token, L MoE layers, E experts.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn

from rlsp.engine.micro import MicroBatch

PREFIX = "actor/moe/"


def find_routers(model: nn.Module) -> dict[str, nn.Module]:
    """The router modules of `model` by name, in layer order: instances of the class its transformers model
    recorder lists for `router_logits`; {} for a dense model."""
    router_class = None
    for module in model.modules():
        recorder = (getattr(module, "_can_record_outputs", None) or {}).get("router_logits")
        router_class = getattr(recorder, "target_class", None)
        if router_class is not None:
            break
    if router_class is None:
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, router_class)}


def _layer_id(name: str, position: int) -> int:
    """The decoder layer index in a router's module name (`model.layers.3.mlp.gate` -> 3), else its position."""
    found = re.search(r"layers\.(\d+)\.", name)
    return int(found.group(1)) if found else position


def _indices(output) -> torch.Tensor | None:
    """The top-k expert indices [N, K] among a router's outputs (its integer tensor), or None."""
    found = [t for t in (output if isinstance(output, tuple) else (output,))
             if isinstance(t, torch.Tensor) and not t.is_floating_point()]
    return found[-1] if found else None


def _num_experts(router: nn.Module) -> int:
    return int(getattr(router, "num_experts", None) or router.weight.shape[0])


class ExpertLoad:
    """Tokens routed to each expert of each MoE layer, accumulated over the micro-batches recorded."""

    def __init__(self, model: nn.Module | None, device: torch.device | str = "cpu") -> None:
        """Hooks the routers of `model` (None: counts nothing); counts live on `device` (the collective's)."""
        routers = find_routers(model) if model is not None else {}
        self.layer_ids = [_layer_id(name, i) for i, name in enumerate(routers)]
        self.num_experts = [_num_experts(r) for r in routers.values()]
        self.counts_LE = torch.zeros(len(routers), max(self.num_experts, default=0), dtype=torch.float64,
                                     device=device)
        self._valid_S: torch.Tensor | None = None
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers.values())]

    @property
    def enabled(self) -> bool:
        return bool(self._handles)

    def _hook(self, row: int):
        def count(module: nn.Module, args, output) -> None:
            if self._valid_S is None:
                return
            idx = _indices(output)
            if idx is None:
                return
            idx_NK = idx.reshape(-1, idx.shape[-1]).to(self.counts_LE.device)
            if idx_NK.shape[0] != self._valid_S.numel():
                raise RuntimeError(f"the router of layer {self.layer_ids[row]} routed {idx_NK.shape[0]} tokens, the "
                                   f"micro-batch holds {self._valid_S.numel()} on this rank; expert load counts need "
                                   "them equal")
            picked = idx_NK[self._valid_S].reshape(-1)
            self.counts_LE[row] += torch.bincount(picked, minlength=self.counts_LE.shape[1]).double()
        return count

    def recording(self, micro: MicroBatch):
        """`counting` this rank's real tokens of `micro` (its shard of the stream, the padding tail left out)."""
        if not self.enabled:
            return nullcontext()
        total = micro.packed.total_len
        return self.counting(micro.local(torch.arange(total) < total - micro.packed.num_pad))

    @contextmanager
    def counting(self, valid_S: torch.Tensor) -> Iterator[None]:
        """Count the routing of the forwards inside; `valid_S` [S] bool marks the tokens that count."""
        self._valid_S = valid_S.reshape(-1).bool().to(self.counts_LE.device)
        try:
            yield
        finally:
            self._valid_S = None

    def reset(self) -> None:
        self.counts_LE.zero_()

    def reduce(self, per_layer: bool = False) -> dict[str, float]:
        """The counts summed over the world (collective; resets them) as metrics: `load_max_over_mean` (max over
        layers of the busiest expert's tokens over the mean per expert), `unused_expert_share` (mean over layers
        of the share of experts that got no token); with `per_layer` both per layer too ({} when dense)."""
        if not self.enabled:
            return {}
        counts_LE = self.counts_LE.clone()
        self.reset()
        if dist.is_initialized():
            dist.all_reduce(counts_LE)
        return compute_load_metrics(counts_LE.cpu(), self.num_experts, self.layer_ids if per_layer else None)


def compute_load_metrics(counts_LE: torch.Tensor, num_experts: list[int],
                         layer_ids: list[int] | None = None) -> dict[str, float]:
    """Load metrics of per-layer token counts per expert (row l uses its first num_experts[l] columns); layers
    that routed no token (or whose router gives no indices) are left out, and with none left there are none.
    With `layer_ids` (the decoder layer of each row) each layer's own two metrics too."""
    ratios, unused = {}, {}
    for row, (counts_E, n) in enumerate(zip(counts_LE, num_experts)):
        counts_E = counts_E[:n]
        mean = float(counts_E.mean())
        if mean > 0:
            ratios[row] = float(counts_E.max()) / mean
            unused[row] = float((counts_E == 0).double().mean())
    if not ratios:
        return {}
    out = {PREFIX + "load_max_over_mean": max(ratios.values()),
           PREFIX + "unused_expert_share": sum(unused.values()) / len(unused)}
    for row, ratio in ratios.items() if layer_ids is not None else ():
        out[f"{PREFIX}layer_{layer_ids[row]}/load_max_over_mean"] = ratio
        out[f"{PREFIX}layer_{layer_ids[row]}/unused_expert_share"] = unused[row]
    return out
