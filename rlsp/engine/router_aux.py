"""The router auxiliary (load-balancing) loss of a mixture-of-experts actor, as transformers computes it.

A MoE config that asks for it (`output_router_logits=True` and `router_aux_loss_coef` > 0) makes transformers'
causal LM add `router_aux_loss_coef * aux_loss` to its loss, `aux_loss` being its modeling module's
`load_balancing_loss_func` of every MoE layer's router logits (Switch Transformer: the number of experts times the
sum over experts of the share of top-k assignments times the mean router probability). `RouterAux` adds the same
term to the actor's loss: forward hooks on the routers (`rlsp.engine.moe_load.find_routers`, output 0 = the logits
transformers records) keep each layer's logits [S, E] of the training forward (armed by a pre-hook on the model's
own forward while grad is enabled, so a gradient-checkpointed layer's recomputation in backward adds nothing), and
`wrap(loss_fn, batch, dp_group)` adds `coef * w * aux` to each micro-batch's loss, where `aux` is the family's own
function of the real tokens of the micro-batch's whole packed stream (its padding tail left out) and `w` the
micro-batch's share of the real tokens of the whole mini-batch (all dp ranks), so the term is the token-weighted
mean of the micro-batches' losses. With one micro-batch it is `model(rows, attention_mask=..., output_router_logits=
True).aux_loss` of its rows (to roundoff).

Under Ulysses / ring each rank routes its shard of the stream: the logits are all-gathered over the stream's ranks
(`gather_from_ranks`, whose backward keeps this rank's slice), so every rank computes the one-rank loss and the
gradients summed over ranks are its gradient; expert parallelism leaves the routers (and their tokens) alone. Under
tensor parallelism every tp rank routes the whole shard (rlsp.parallel.tp_families.LocalReplicatedMoE) and computes
the loss whole: with sequence-parallel activations its gradients are a share summed over tp, so it adds 1/tp of it.
Metric `actor/router_aux_loss` (the weighted mean, shares summed over ranks). Under routing replay (R2 / R3) the
loss is still the family's function of the current logits (its top-k taken from them, as transformers does), not of
the replayed routes. Families: those whose modeling module has `load_balancing_loss_func` and whose causal LM adds it,
tested against it (`AUX_LOSS_TYPES`); `router_aux_errors` refuses the others (glm4_moe and deepseek_v3 have no
auxiliary loss in transformers: their routers balance by a correction bias) and adaptive Ulysses by name.

Legend: S local tokens, T packed stream, N real tokens of the stream, E experts, L MoE layers.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlsp.data.batch import Batch
from rlsp.engine.micro import MicroBatch
from rlsp.engine.moe_load import find_routers
from rlsp.parallel.ulysses import gather_from_ranks

METRIC = "actor/router_aux_loss"
# Families whose causal LM adds load_balancing_loss_func of the recorded router logits (tested against it).
AUX_LOSS_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gpt_oss", "qwen3_next", "qwen3_5_moe_text")
LossFn = Callable[[dict[str, torch.Tensor], MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def aux_loss_coef(config: Any) -> float:
    """The coefficient the model config asks for: `router_aux_loss_coef` when `output_router_logits` is set, else 0."""
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def router_aux_errors(config: Any, actor: Any = None) -> list[str]:
    """Why the router auxiliary loss `config` asks for cannot be trained on the actor's layout `actor` (a RoleLayout;
    None: degree 1) ([] when it is off or can)."""
    coef = aux_loss_coef(config)
    if coef <= 0:
        return []
    adaptive = bool(getattr(actor, "adaptive", False))
    model_type = getattr(config, "model_type", "?")
    what = f"output_router_logits=True with router_aux_loss_coef={coef:g} (model {model_type})"
    if model_type not in AUX_LOSS_TYPES:
        return [f"{what}: the router auxiliary loss is implemented for {', '.join(AUX_LOSS_TYPES)} (transformers' "
                "load_balancing_loss_func); set output_router_logits=False or router_aux_loss_coef=0 for this family"]
    errors = []
    if adaptive:
        errors.append(f"{what} with adaptive Ulysses: a micro-batch's ranks vary; legal: a fixed "
                      "ulysses_sequence_parallel_size or router_aux_loss_coef=0")
    return errors


def _loss_function(lm: nn.Module) -> Callable[..., torch.Tensor]:
    """`load_balancing_loss_func` of the modeling module of `lm`'s class (the family's own formula)."""
    module = importlib.import_module(type(lm).__module__)
    func = getattr(module, "load_balancing_loss_func", None)
    if func is None:
        raise ValueError(f"{type(lm).__name__} ({module.__name__}) has no load_balancing_loss_func; the router "
                         f"auxiliary loss is implemented for {', '.join(AUX_LOSS_TYPES)}")
    return func


class RouterAux:
    """Router logits of the training forward and the auxiliary loss they give; off (no hooks) when coef is 0."""

    def __init__(self, model: nn.Module, lm: nn.Module, coef: float) -> None:
        """`model`: the module whose forward runs one micro-batch (arms the hooks); `lm`: the HF causal LM."""
        self.coef = coef
        routers = find_routers(lm) if coef > 0 else {}
        if coef > 0 and not routers:
            raise ValueError(f"router_aux_loss_coef={coef:g} needs a mixture-of-experts model; "
                             f"{type(lm).__name__} has no router")
        self.num_experts = [int(getattr(r, "num_experts", None) or r.weight.shape[0]) for r in routers.values()]
        self.top_k = int(getattr(lm.config, "num_experts_per_tok", 0) or 0)
        self._func = _loss_function(lm) if routers else None
        self._logits: list[torch.Tensor] = []
        self._armed = False
        self._handles = [r.register_forward_hook(self._keep) for r in routers.values()]
        if self._handles:
            self._handles.append(model.register_forward_pre_hook(self._arm))

    @property
    def enabled(self) -> bool:
        return bool(self._handles)

    def _arm(self, module: nn.Module, args: Any) -> None:
        self._logits = []
        self._armed = torch.is_grad_enabled()

    def _keep(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._armed:
            self._logits.append(output[0] if isinstance(output, tuple) else output)

    def take_loss(self, micro: MicroBatch) -> torch.Tensor | None:
        """The family's auxiliary loss of the stream of `micro` from the logits of its forward (collective over the
        stream's ranks); None for a stream of padding only. Disarms the hooks until the next forward."""
        logits, self._logits, self._armed = self._logits, [], False
        if len(logits) != len(self.num_experts):
            raise RuntimeError(f"the routers gave {len(logits)} logits tensors in this forward; the model has "
                               f"{len(self.num_experts)} MoE layers")
        real = micro.packed.total_len - micro.packed.num_pad
        if real == 0:
            return None
        full = tuple(gather_from_ranks(x.reshape(micro.ctx.local_len, -1), micro.ctx)[:real] for x in logits)
        return self._func(full, self.num_experts[0], self.top_k, None)

    def wrap(self, loss_fn: LossFn, batch: Batch, dp_group: dist.ProcessGroup | None) -> LossFn:
        """`loss_fn` plus coef x each micro-batch's auxiliary loss weighted by its share of the real tokens of the
        mini-batch (`batch` is this rank's share; the sum runs over `dp_group`, collective); unchanged when off."""
        if not self.enabled:
            return loss_fn
        total = batch["attention_mask"].sum().to(torch.float64).reshape(1)
        if dp_group is not None and dist.is_initialized():
            dist.all_reduce(total, group=dp_group)
        total_tokens = max(float(total.item()), 1.0)

        def with_aux(out: dict[str, torch.Tensor], micro: MicroBatch):
            loss, metrics = loss_fn(out, micro)
            aux = self.take_loss(micro)
            if aux is None:  # a stream of padding: every rank still reports the key (metrics are reduced by key)
                return loss, {**metrics, METRIC: torch.zeros((), dtype=torch.float64)}
            weight = (micro.packed.total_len - micro.packed.num_pad) / total_tokens
            shares = _tp_shares(micro)
            ranks = micro.ctx.ulysses_size * micro.ctx.ring_size * shares  # each holds the whole value: metrics sum
            metrics = {**metrics, METRIC: (weight * aux).detach() / ranks}
            return loss + self.coef * weight * aux.to(loss.device) / shares, metrics

        return with_aux


def _tp_shares(micro: MicroBatch) -> int:
    """How many tp ranks' loss shares sum to the gradient: tp under sequence parallelism (each tp rank's gradients
    are a Partial share, rlsp.parallel.tensor_parallel.TPInfo), so each adds 1/tp of the auxiliary loss it computes
    whole; 1 otherwise (every tp rank's gradient is complete, the metric reduction divides by the replicas)."""
    tp = micro.tp
    return tp.size if tp is not None and tp.sequence_parallel else 1


def override_entries(override_config: Any) -> dict[str, Any]:
    """The config.json entries `actor_rollout_ref.model.override_config` sets (its None entries keep the file's)."""
    keys = ("output_router_logits", "router_aux_loss_coef")
    return {k: getattr(override_config, k) for k in keys if getattr(override_config, k, None) is not None}


def with_overrides(config: Any, override_config: Any) -> Any:
    """A copy of the model config `config` with `override_entries(override_config)` set."""
    config = copy.copy(config)
    for key, value in override_entries(override_config).items():
        setattr(config, key, value)
    return config
