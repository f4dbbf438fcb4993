"""RolloutRole: this rank's in-process generation engine (vLLM, or the hf engine: transformers' model with rlsp's decoding loop).

With agent loops (`multi_turn.enable`, or a verl agent-loop command) every sample runs through its row's
loop (rlsp.agent; rows built in rlsp/workers/agent_rollout.py); otherwise one generate call per batch.

With rollout tensor parallelism (`actor_rollout_ref.rollout.tensor_model_parallel_size` = k) k
consecutive ranks run one vLLM engine together, each holding 1/k of the weights: they get the same
prompts (`generate` is dispatched by dp group of the rollout layout, one group per engine), the same
engine seed, and each keeps its own shard of every full tensor a weight sync hands it.

Partial rollouts (`async_training.partial_rollout=true`, a rollout pool of its own): the driver gives
the role a weight feed (`follow_weights`), an object with `poll()` that returns (version, full tensors)
when the trainer has published weights newer than the ones this engine holds, else None. `generate`
polls before it starts and between segments of `async_training.partial_rollout_segment_tokens` tokens
(rlsp/rollout/segments.py), so a weight change reaches a running generation at the next segment
boundary instead of queueing behind it (with agent loops: at the next turn boundary). Every sample records the oldest (`policy_version`) and newest
(`policy_version_max`) version among its tokens, and `token_version` the version of each token.

Routing replay R3 (rlsp.engine.router_replay.replay_mode): the hf engine records each sample's MoE routes, which become
the rows' ROUTES_KEY column that the old-logprob pass and the update replay (single-turn, one-shot generation only).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from rlsp.agent.runner import AgentRunner
from rlsp.data.batch import Batch
from rlsp.data.dataset import chat_template_kwargs
from rlsp.data.vision_run import policy_vision_tower
from rlsp.engine.moe_load import find_routers
from rlsp.engine.router_replay import ROUTES_KEY, replay_mode
from rlsp.models.vision_inputs import MM_KEY
from rlsp.rollout import SamplingConfig, build_rollout_engine
from rlsp.rollout.engine_options import vllm_engine_options
from rlsp.rollout.segments import SegmentedOutput, generate_in_segments
from rlsp.workers.agent_rollout import agent_generate
from rlsp.workers.columns import IMAGE_INPUTS, ROW_FIELDS
from rlsp.workers.context import RoleContext
from rlsp.workers.dispatch import Dispatch, register
from rlsp.workers.rollout_rows import build_rollout_rows

# What generation leaves on the worker (rlsp.workers.rollout_rows, rlsp.workers.agent_rollout) and what
# the driver receives instead: per-row counts and the small per-row entries it groups and reports by.
ROLLOUT_WRITES = ("input_ids", "attention_mask", "position_ids", "response_mask", "rollout_logprobs", "token_version",
                  "policy_version", "policy_version_max", "step_rewards", "agent_metrics", ROUTES_KEY, *ROW_FIELDS,
                  *IMAGE_INPUTS)
ROLLOUT_REPORTS = ("num_tokens", "response_tokens", "response_length", "step_reward_sum", "step_reward_policy_sum",
                   "policy_version", "policy_version_max", "uid", "data_source", "index", "agent_name", "agent_metrics")


class WeightFeed(Protocol):
    """Newer weights than the last ones handed out, if the trainer published any (see the module docstring)."""

    def poll(self) -> tuple[int, list[tuple[str, torch.Tensor]]] | None: ...


class RolloutRole:
    def __init__(self, ctx: RoleContext) -> None:
        self.ctx, self.cfg = ctx, ctx.cfg
        self.version = 0  # actor updates behind the weights this engine holds (set by `set_weights`)
        self.feed: WeightFeed | None = None  # partial rollouts: where newer weights are picked up
        r, d = ctx.cfg.actor_rollout_ref.rollout, ctx.cfg.data
        self.record_routes = replay_mode(ctx.cfg.actor_rollout_ref) == "R3"  # the engine returns each sample's routes
        engine_rank = ctx.layout.role("rollout").dp_rank(ctx.rank)  # the ranks of one tp engine share it
        self.engine = build_rollout_engine(
            r.name, ctx.cfg.actor_rollout_ref.model.path, dtype=r.dtype, seed=ctx.cfg.trainer.seed + engine_rank,
            max_model_len=d.max_prompt_length + d.max_response_length, **self._engine_kwargs(),
        )
        self.agent = self._agent_runner() if ctx.spec.agent_loops else None

    def _agent_runner(self) -> AgentRunner:
        from transformers import AutoTokenizer  # noqa: PLC0415 -- only agent loops decode and render turns here

        tokenizer = AutoTokenizer.from_pretrained(self.cfg.actor_rollout_ref.model.path)
        return AgentRunner(self.cfg.actor_rollout_ref.rollout, tokenizer, chat_template_kwargs(self.cfg))

    def _engine_kwargs(self) -> dict[str, Any]:
        r = self.cfg.actor_rollout_ref.rollout
        if r.name == "vllm":
            # vLLM joins the existing world ("external_launcher": every rank runs its engine, or its tp
            # share of one) instead of creating a default process group of its own.
            # load_format (verl's key, vLLM's meaning): "dummy" starts from random weights, which the
            # worker replaces with the actor's by a sync before anything is generated.
            return {"enforce_eager": r.enforce_eager, "gpu_memory_utilization": r.gpu_memory_utilization,
                    "cpu_kvcache_space_gib": r.cpu_kvcache_space_gib, "distributed_executor_backend": "external_launcher",
                    "load_format": r.load_format, "tensor_parallel_size": self.ctx.layout.rollout_tp,
                    "multi_stage_wake_up": r.multi_stage_wake_up,  # GPU: weights, then the KV cache, per sync
                    **vllm_engine_options(r, self.ctx.prompt_len + self.cfg.data.max_response_length,
                                          on_gpu=self.ctx.device.type == "cuda")}  # verl's engine options
        extra: dict[str, Any] = {"route_finder": find_routers} if self.record_routes else {}  # R3: rlsp.rollout.route_capture
        if policy_vision_tower(self.cfg):  # a Qwen3.5 wrapper whose rows carry images: the actor's class, tower included
            extra["vision_tower"] = True
        return {"device": str(self.ctx.device), **extra}  # resolved (cuda:<i>), like the training engines' device

    @register(Dispatch.BY_DP, reads=("prompt_index", "prompt_ids", *ROW_FIELDS, *IMAGE_INPUTS), writes=ROLLOUT_WRITES,
              reports=ROLLOUT_REPORTS, new_rows=True)
    def generate(self, prompts: Batch, sampling: dict[str, Any]) -> Batch:
        """Sample `n` responses per prompt; rows of one prompt are contiguous and share its meta."""
        if sampling.get("seed") is not None and len(prompts):
            # Sample j of the prompt with global index g gets seed + g * n + j (vLLM counts j itself), so
            # what is sampled does not depend on how prompts were split over ranks (resharded resume).
            first = int(prompts["prompt_index"][0])
            sampling = {**sampling, "seed": int(sampling["seed"]) + first * int(sampling.get("n", 1))}
        cfg = SamplingConfig(**sampling)
        prompt_ids: list[list[int]] = prompts.meta["prompt_ids"]
        t0 = time.perf_counter()
        self.engine.wake_up()
        if self.agent is not None:
            rows, meta = self._generate_agent(prompts, cfg)
        else:
            gen = self._generate(prompt_ids, cfg, prompts.meta.get(MM_KEY))
            out = gen.out
            rows = build_rollout_rows(
                [prompt_ids[i] for i in out.prompt_index], out.response_ids, out.response_logprobs,
                self.ctx.prompt_len, cfg.max_tokens, self.ctx.pad_token_id, gen.token_versions, self.version,
                routes=self._routes(out),
            )
            meta = {k: [v[i] for i in out.prompt_index] for k, v in prompts.meta.items() if k != "prompt_ids"}
        # Free the engine's accelerator memory for training (no-op on CPU); weight sync wakes it.
        self.engine.sleep()
        return Batch.from_dict(rows, meta=meta, info={"gen_s": time.perf_counter() - t0})

    def _routes(self, out: Any) -> list[torch.Tensor] | None:
        """R3: each sample's routes from the engine's output (rlsp.rollout.route_capture.RoutedOutput), else None."""
        if not self.record_routes:
            return None
        if getattr(out, "routes", None) is None:
            raise RuntimeError(f"router replay R3: the {self.cfg.actor_rollout_ref.rollout.name} rollout returned no "
                               "routes (one-shot generation with rollout.name=hf records them)")
        return out.routes

    def _generate_agent(self, prompts: Batch, cfg: SamplingConfig) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Agent loops (multi-turn): with a weight feed, newer weights are picked up at turn boundaries."""
        on_boundary = None
        if self.feed is not None:
            self._pick_up_weights()
            on_boundary = self._pick_up_weights
        return agent_generate(self.agent, self.engine, prompts, cfg, (self.ctx.prompt_len, cfg.max_tokens),
                              self.ctx.pad_token_id, self.version, on_boundary)

    def _generate(self, prompt_ids: list[list[int]], cfg: SamplingConfig, images: list[Any] | None) -> SegmentedOutput:
        """One-shot generation, or segment-wise with weight pick-ups when following a weight feed; `images`: each
        prompt's processor outputs (None: text), for the engines that take them (refused before start-up elsewhere)."""
        with_images = {"images": images} if images is not None and any(e is not None for e in images) else {}
        if self.feed is None:
            out = self.engine.generate(prompt_ids, cfg, **with_images)
            return SegmentedOutput(out, [[self.version] * len(r) for r in out.response_ids])
        self._pick_up_weights()
        segment = int(self.cfg.async_training.partial_rollout_segment_tokens)
        return generate_in_segments(self.engine, prompt_ids, cfg, segment, self.version, self._pick_up_weights,
                                    **with_images)  # each continued request keeps its prompt's images

    def _pick_up_weights(self) -> int:
        """Load the feed's weights if they are newer than the engine's; returns the version held now."""
        if (newer := self.feed.poll()) is not None:
            version, named_tensors = newer
            self.load_weights(named_tensors)
            self.version = int(version)
        return self.version

    @register(Dispatch.ALL)
    def follow_weights(self, feed: WeightFeed) -> None:
        """Partial rollouts: pick up weights from `feed` before and during every generation."""
        self.feed = feed

    def sleep(self) -> None:
        """Give the engine's accelerator memory back (no-op on CPU); generation and weight loads wake it."""
        self.engine.sleep()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.cfg.actor_rollout_ref.rollout.name != "vllm":  # vLLM wakes what a load needs (multi_stage_wake_up)
            self.engine.wake_up()
        self.engine.update_weights(named_tensors)

    @register(Dispatch.ALL)
    def set_weights(self, named_tensors: list[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        """A rollout pool of its own: the trainer's full weights after `version` actor updates."""
        t0 = time.perf_counter()
        self.load_weights(named_tensors)
        self.version = int(version)
        return {"weight_load_s": time.perf_counter() - t0}

    @register(Dispatch.ALL)
    def prompt_logprobs(self, token_ids: list[int]) -> list[float | None]:
        self.engine.wake_up()
        return self.engine.prompt_logprobs(token_ids)
