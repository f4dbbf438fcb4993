"""MoE routing replay (verl's `actor_rollout_ref.actor.router_replay.mode`). R2: the update pass routes every token to
the experts the old-logprob pass chose. R3: the old-logprob pass and the update route every token to the experts the
rollout engine chose while sampling it (the hf engine records them: rlsp.rollout.route_capture; the rows carry them
under ROUTES_KEY from generation on, rlsp.workers.rollout_rows). The reference model routes freely in both (its own
engine, or the actor's base with LoRA, never records or replays), as verl's reference does unless configured.

Recording (`RouterReplay.recording`): a forward hook on every router module (`rlsp.engine.moe_load.find_routers`)
keeps the top-k expert indices of the tokens this rank routes; `recorded_rows(micro)` gathers them over the ranks
that split the stream (like the logprobs) into per-row columns [B, P+R, L, K] (int16, zeros where a row has no token).

Replay (`RouterReplay.replaying(micro, routes)`): the same hooks return a new router output -- the current router
logits, the recorded indices, and the routing weights recomputed from the current logits at those indices by the
family's own rule (softmax + optional renormalisation; gpt_oss's softmax over the chosen logits; glm4_moe's and
deepseek_v3's sigmoid + renormalisation + scaling, whose correction bias and expert groups only rank). The choice
is fixed; gradients flow through the weights. Replaying the routes of the same weights reproduces the router's own
output exactly (gathering the probabilities at the top-k indices gives the top-k values bit for bit).

Families whose router output this cannot reproduce exactly (routers without indices, unknown rules) are refused by
name (`check_replayable`). Under tensor parallelism every tp rank records and replays the routes of the whole
sequence shard (its MoE blocks run replicated over tp), so the routes are the same on every tp rank.
Legend: B rows, P prompt width, R response width, T stream, S local tokens, L MoE layers,
K experts per token, E experts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rlsp.data.packing import pack_values, unpack_to_rows
from rlsp.engine.micro import MicroBatch
from rlsp.engine.moe_load import find_routers
from rlsp.parallel.ulysses import gather_from_ranks

ROUTES_KEY = "router_routes"  # the per-row column recorded by compute_log_prob (R2) or the rollout (R3), then replayed
ROUTE_DTYPE = torch.int16
MODES = ("disabled", "R2", "R3")
MODE_KEY = "actor_rollout_ref.actor.router_replay.mode"
ROLLOUT_SWITCH = "actor_rollout_ref.rollout.enable_rollout_routing_replay"  # verl's R3 switch: the same setting
R3_ROLLOUT_ENGINES = ("hf",)  # the rollout engines that return each token's routes
# config.json model_type -> its router class, for the families whose router output R2 reproduces exactly
REPLAYABLE_TYPES = {"qwen2_moe": "Qwen2MoeTopKRouter", "qwen3_moe": "Qwen3MoeTopKRouter", "olmoe": "OlmoeTopKRouter",
                    "mixtral": "MixtralTopKRouter", "glm4_moe": "Glm4MoeTopkRouter",
                    "deepseek_v3": "DeepseekV3TopkRouter", "gpt_oss": "GptOssTopKRouter"}


def _softmax_weights(router: nn.Module, logits_NE: torch.Tensor, idx_NK: torch.Tensor) -> torch.Tensor:
    """Qwen2Moe / Qwen3Moe / Olmoe: softmax in fp32, top-k values, renormalised when norm_topk_prob, logits dtype."""
    weights_NK = torch.softmax(logits_NE, dtype=torch.float, dim=-1).gather(1, idx_NK)
    if router.norm_topk_prob:
        weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
    return weights_NK.to(logits_NE.dtype)


def _mixtral_weights(router: nn.Module, logits_NE: torch.Tensor, idx_NK: torch.Tensor) -> torch.Tensor:
    """Mixtral: softmax of the fp32 logits, top-k values always renormalised, kept in fp32."""
    weights_NK = torch.softmax(logits_NE.float(), dim=-1).gather(1, idx_NK)
    return weights_NK / weights_NK.sum(dim=-1, keepdim=True)


def _gpt_oss_weights(router: nn.Module, logits_NE: torch.Tensor, idx_NK: torch.Tensor) -> torch.Tensor:
    """GptOss: softmax over the chosen experts' logits only, in the logits' dtype."""
    return torch.softmax(logits_NE.gather(1, idx_NK), dim=1, dtype=logits_NE.dtype)


def _glm4_weights(router: nn.Module, logits_NE: torch.Tensor, idx_NK: torch.Tensor) -> torch.Tensor:
    """Glm4Moe, DeepseekV3: sigmoid scores at the chosen experts (the correction bias only ranks), renormalised, scaled."""
    weights_NK = logits_NE.sigmoid().gather(1, idx_NK)
    if router.norm_topk_prob:
        weights_NK = weights_NK / (weights_NK.sum(dim=-1, keepdim=True) + 1e-20)
    return weights_NK * router.routed_scaling_factor


WeightRule = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
# router class name -> how it turns its logits at the chosen experts into routing weights (transformers 5.19)
WEIGHT_RULES: dict[str, WeightRule] = {
    "Qwen2MoeTopKRouter": _softmax_weights,
    "Qwen3MoeTopKRouter": _softmax_weights,
    "OlmoeTopKRouter": _softmax_weights,
    "MixtralTopKRouter": _mixtral_weights,
    "Glm4MoeTopkRouter": _glm4_weights,
    "DeepseekV3TopkRouter": _glm4_weights,
    "GptOssTopKRouter": _gpt_oss_weights,
}


def check_replayable(model: nn.Module, model_type: str = "") -> dict[str, nn.Module]:
    """The routers of `model` when R2 / R3 can replay them exactly; ValueError naming the model type and router class
    otherwise (a dense model, or a router whose output rlsp does not reproduce)."""
    routers = find_routers(model)
    if not routers:
        raise ValueError(f"actor_rollout_ref.actor.router_replay (R2, R3) needs a mixture-of-experts model; model_type="
                         f"{model_type!r} has no router; set router_replay.mode=disabled")
    names = sorted({type(r).__name__ for r in routers.values()})
    unknown = [n for n in names if n not in WEIGHT_RULES]
    if unknown:
        raise ValueError(f"actor_rollout_ref.actor.router_replay (R2, R3) cannot replay the router {unknown[0]} of "
                         f"model_type={model_type!r} exactly; replayable routers: {sorted(WEIGHT_RULES)}; set "
                         "router_replay.mode=disabled")
    return routers


class RouterReplay:
    """Records the routes of a MoE model's forwards, or replays given routes, per micro-batch."""

    def __init__(self, model: nn.Module, model_type: str = "") -> None:
        self.routers = list(check_replayable(model, model_type).values())
        self.top_k = int(self.routers[0].top_k)
        self._recorded: list[torch.Tensor | None] = [None] * len(self.routers)
        self._replay_SLK: torch.Tensor | None = None
        self._recording = False
        # prepended: hooks registered earlier (expert load counts) see the replayed routing
        self._handles = [r.register_forward_hook(self._hook(i), prepend=True) for i, r in enumerate(self.routers)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _hook(self, layer: int):
        def route(module: nn.Module, args, output):
            if self._recording:
                self._recorded[layer] = output[-1].detach().reshape(-1, self.top_k).to(ROUTE_DTYPE).cpu()
                return None
            if self._replay_SLK is None:
                return None
            logits_NE = output[0]
            idx_NK = self._replay_SLK[:, layer].to(device=logits_NE.device, dtype=torch.long)
            if idx_NK.shape[0] != logits_NE.shape[0]:
                raise RuntimeError(f"router replay: MoE layer {layer} routes {logits_NE.shape[0]} tokens on this "
                                   f"rank, the replayed routes hold {idx_NK.shape[0]}; they must be equal")
            weights_NK = WEIGHT_RULES[type(module).__name__](module, logits_NE, idx_NK)
            return (logits_NE, weights_NK, idx_NK.to(output[-1].dtype))
        return route

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Keep the routes of the forwards inside (the last forward's, per layer)."""
        self._recorded = [None] * len(self.routers)
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def recorded_local(self) -> torch.Tensor:
        """This rank's recorded routes [S, L, K] of the last forward recorded."""
        if any(r is None for r in self._recorded):
            raise RuntimeError("router replay: no forward was recorded on every MoE layer")
        return torch.stack(self._recorded, dim=1)

    def recorded_rows(self, micro: MicroBatch) -> torch.Tensor:
        """The recorded routes of `micro` as row columns [B, P+R, L, K] (collective over the stream's ranks)."""
        routes_T = gather_from_ranks(self.recorded_local().to(torch.int32), micro.ctx).cpu()  # int32: collectives
        return unpack_to_rows(routes_T, micro.packed).to(ROUTE_DTYPE)

    @contextmanager
    def replaying(self, micro: MicroBatch, routes_BLLK: torch.Tensor) -> Iterator[None]:
        """Route the forwards (and checkpoint recomputations) inside by `routes_BLLK` [B, P+R, L, K] of the rows."""
        routes_TLK = pack_values(routes_BLLK, micro.packed)
        routes_TLK[micro.packed.num_real:] = torch.arange(self.top_k, dtype=routes_TLK.dtype)  # padding: distinct experts
        with self.replaying_local(micro.local(routes_TLK)):
            yield

    @contextmanager
    def replaying_local(self, routes_SLK: torch.Tensor) -> Iterator[None]:
        """Route the forwards inside by this rank's routes [S, L, K] (the tokens in the order the routers see)."""
        self._replay_SLK = routes_SLK
        try:
            yield
        finally:
            self._replay_SLK = None


def recording_routes(replay: RouterReplay | None, record: bool) -> AbstractContextManager[None]:
    """`replay.recording()` when `record` (an engine built without router replay cannot record), else nothing."""
    if not record:
        return nullcontext()
    if replay is None:
        raise RuntimeError("record_routes=True on an engine built without router_replay (actor.router_replay.mode=R2)")
    return replay.recording()


def infer_routing(replay: RouterReplay | None, micro: MicroBatch, record: bool,
                  replay_rows: bool) -> AbstractContextManager[None]:
    """The routing of an inference pass over `micro`: recording it (R2's old-logprob pass), replaying the rows' routes
    (R3's old-logprob pass: the rollout's; the rows must carry them), or free."""
    if not replay_rows:
        return recording_routes(replay, record)
    if record:
        raise ValueError("record_routes and replay_routes exclude each other: a pass either records routes or replays them")
    if replay is None:
        raise RuntimeError("replay_routes=True on an engine built without router_replay (actor.router_replay.mode=R3)")
    if ROUTES_KEY not in micro.rows.tensors.keys():
        raise RuntimeError(f"router replay R3: the rows carry no {ROUTES_KEY!r} column (the rollout engine recorded "
                           "no routes); the rollout must run with actor_rollout_ref.rollout.name=hf")
    return replay.replaying(micro, micro.rows[ROUTES_KEY])


def replaying_rows(replay: RouterReplay | None, micro: MicroBatch) -> AbstractContextManager[None]:
    """The update of `micro`: its rows' routes (ROUTES_KEY: R2's recorded ones, R3's rollout ones) when they carry them, else
    free routing."""
    if replay is None or ROUTES_KEY not in micro.rows.tensors.keys():
        return nullcontext()
    return replay.replaying(micro, micro.rows[ROUTES_KEY])


def replay_mode(arr: Any) -> str:
    """The routing replay mode of `actor_rollout_ref` (`arr`): router_replay.mode, or R3 where verl's rollout switch
    enable_rollout_routing_replay=true says so and the mode is left at disabled (refused against another mode:
    `replay_config_errors`)."""
    mode = str(arr.actor.router_replay.mode)
    return "R3" if bool(getattr(arr.rollout, "enable_rollout_routing_replay", False)) and mode == "disabled" else mode


@dataclass(frozen=True)
class RolloutFacts:
    """What of the rollout decides whether R3 can run: the engine, its tensor-parallel degree, agent loops (several
    engine calls per sample) and partial rollouts (generation in segments)."""

    engine: str = "hf"
    tp: int = 1
    agent_loops: bool = False
    partial_rollout: bool = False


def replay_config_errors(arr: Any, config, agent_loops: bool = False, partial_rollout: bool = False) -> list[str]:
    """`router_replay_errors` of `actor_rollout_ref` (`arr`) for the model `config`, verl's R3 switch included."""
    mode = str(arr.actor.router_replay.mode)
    if bool(getattr(arr.rollout, "enable_rollout_routing_replay", False)) and mode not in ("disabled", "R3"):
        return [f"{ROLLOUT_SWITCH}=true (verl's R3 switch) and {MODE_KEY}={mode!r} are the same setting with different "
                f"values; legal: {MODE_KEY}=R3 with the switch, or the switch unset (false)"]
    facts = RolloutFacts(str(arr.rollout.name), int(arr.rollout.tensor_model_parallel_size), agent_loops, partial_rollout)
    return router_replay_errors(replay_mode(arr), config, int(arr.actor.tensor_model_parallel_size), facts)


def _r3_errors(rollout: RolloutFacts) -> list[str]:
    """What of the rollout refuses R3 (the routes must come back with every sampled token)."""
    key = f"{MODE_KEY}=R3"
    if rollout.engine not in R3_ROLLOUT_ENGINES:
        return [f"{key} with actor_rollout_ref.rollout.name={rollout.engine!r}: rlsp's vLLM engine returns no routes "
                "(vLLM's enable_return_routed_experts is not wired into it); legal: rollout.name=hf, or "
                "router_replay.mode=R2 (the old-logprob pass's routes)"]
    if rollout.tp > 1:
        return [f"{key} with actor_rollout_ref.rollout.tensor_model_parallel_size={rollout.tp}: the hf engine records "
                "routes in one process only; legal: rollout.tensor_model_parallel_size=1"]
    if rollout.agent_loops:
        return [f"{key} with agent loops (rollout.multi_turn.enable or an agent loop): a sample's turns come from several "
                "engine calls with tool tokens between them, whose routes rlsp does not assemble into rows; legal: "
                "single-turn rollouts, or router_replay.mode=R2"]
    if rollout.partial_rollout:
        return [f"{key} with async_training.partial_rollout=true: a sample generated in segments is re-prefilled per "
                "segment, whose routes rlsp does not assemble into rows; legal: partial_rollout=false, or "
                "router_replay.mode=R2"]
    return []


def router_replay_errors(mode: str, config, tp: int = 1, rollout: RolloutFacts | None = None) -> list[str]:
    """What refuses actor_rollout_ref.actor.router_replay.mode=`mode` for the model `config` (a transformers config)
    at tensor-parallel degree `tp` with `rollout` (R3; default: the hf engine, single-turn), before any worker starts;
    [] when the run can use it. Any `tp` the model takes (rlsp.parallel.tp_checks) replays: every tp rank's routers
    route the whole sequence shard (rlsp.parallel.tp_families.LocalReplicatedMoE), as the routes are laid out."""
    key = MODE_KEY
    model_type = getattr(config, "model_type", None)
    if mode not in MODES:
        return [f"{key}={mode!r}; legal: {', '.join(MODES)}"]
    if mode == "disabled":
        return []
    if mode == "R3" and (problems := _r3_errors(rollout or RolloutFacts())):
        return problems
    if not any(getattr(config, a, None) for a in ("num_experts", "num_local_experts", "n_routed_experts")):
        return [f"{key}={mode} needs a mixture-of-experts model; model_type={model_type!r} is dense (no router); set "
                "router_replay.mode=disabled"]
    if model_type not in REPLAYABLE_TYPES:
        return [f"{key}={mode}: the router of model_type={model_type!r} is not reproduced exactly by rlsp's replay "
                f"(replayable: {', '.join(REPLAYABLE_TYPES)}); set router_replay.mode=disabled"]
    return []
