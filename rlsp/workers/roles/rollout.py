"""RolloutRole: this rank's in-process generation engine (vLLM, or HF generate as a fallback).

With rollout tensor parallelism (`actor_rollout_ref.rollout.tensor_model_parallel_size` = k) k
consecutive ranks run one vLLM engine together, each holding 1/k of the weights: they get the same
prompts (`generate` is dispatched by dp group of the rollout layout, one group per engine), the same
engine seed, and each keeps its own shard of every full tensor a weight sync hands it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from rlsp.data.batch import Batch
from rlsp.rollout import SamplingConfig, build_rollout_engine
from rlsp.workers.context import RoleContext
from rlsp.workers.dispatch import Dispatch, register
from rlsp.workers.rollout_rows import build_rollout_rows


class RolloutRole:
    def __init__(self, ctx: RoleContext) -> None:
        self.ctx, self.cfg = ctx, ctx.cfg
        self.version = 0  # actor updates behind the weights this engine holds (set by `set_weights`)
        r, d = ctx.cfg.actor_rollout_ref.rollout, ctx.cfg.data
        engine_rank = ctx.layout.role("rollout").dp_rank(ctx.rank)  # the ranks of one tp engine share it
        self.engine = build_rollout_engine(
            r.name, ctx.cfg.actor_rollout_ref.model.path, dtype=r.dtype, seed=ctx.cfg.trainer.seed + engine_rank,
            max_model_len=d.max_prompt_length + d.max_response_length, **self._engine_kwargs(),
        )

    def _engine_kwargs(self) -> dict[str, Any]:
        r = self.cfg.actor_rollout_ref.rollout
        if r.name == "vllm":
            # vLLM joins the existing world ("external_launcher": every rank runs its engine, or its tp
            # share of one) instead of creating a default process group of its own.
            # load_format (verl's key, vLLM's meaning): "dummy" starts from random weights, which the
            # worker replaces with the actor's by a sync before anything is generated.
            return {"enforce_eager": r.enforce_eager, "gpu_memory_utilization": r.gpu_memory_utilization,
                    "cpu_kvcache_space_gib": r.cpu_kvcache_space_gib, "distributed_executor_backend": "external_launcher",
                    "load_format": r.load_format, "tensor_parallel_size": r.tensor_model_parallel_size}
        return {"device": self.ctx.device_type}

    @register(Dispatch.BY_DP)
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
        out = self.engine.generate(prompt_ids, cfg)
        # Free the engine's accelerator memory for training (no-op on CPU); weight sync wakes it.
        self.engine.sleep()
        rows = build_rollout_rows(
            [prompt_ids[i] for i in out.prompt_index], out.response_ids, out.response_logprobs,
            self.ctx.prompt_len, cfg.max_tokens, self.ctx.pad_token_id,
        )
        meta = {k: [v[i] for i in out.prompt_index] for k, v in prompts.meta.items() if k != "prompt_ids"}
        # The policy version of every sample (async training: actor updates behind the weights it came from).
        rows["policy_version"] = torch.full((len(out.response_ids),), self.version, dtype=torch.long)
        return Batch.from_dict(rows, meta=meta, info={"gen_s": time.perf_counter() - t0})

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
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
