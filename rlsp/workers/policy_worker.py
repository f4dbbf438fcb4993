"""PolicyWorker: one per device — the FSDP2 actor, the frozen reference, and an in-process rollout engine.

A plain class (no ray import): the controller wraps it as a Ray actor, tests drive it directly.
Dispatch contract (see rlsp/controller): `generate` gets a shard of prompts per *rank*; the logprob
and update methods get a shard per *dp group* (every sp rank of a group gets the same rows) and are
collective over the whole world.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer, GenerationConfig

from rlsp.data.batch import Batch
from rlsp.engine.fsdp_engine import DTYPES, FSDPEngine
from rlsp.parallel.mesh import build_parallel_dims
from rlsp.rollout import SamplingConfig, build_rollout_engine
from rlsp.utils.device import backend_for, resolve_device_type
from rlsp.utils.logging import get_logger
from rlsp.utils.seeding import seed_everything
from rlsp.workers.actor_loss import ActorLossConfig, make_actor_loss
from rlsp.workers.rollout_rows import build_rollout_rows

log = get_logger("rlsp.policy")


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class PolicyWorker:
    def __init__(self, config: dict[str, Any], rank: int, world_size: int) -> None:
        self.cfg: DictConfig = OmegaConf.create(config)
        self.rank, self.world_size = rank, world_size
        os.environ["RANK"] = str(rank)

    def rendezvous_address(self) -> tuple[str, int]:
        host = "127.0.0.1" if self.cfg.trainer.nnodes == 1 else socket.gethostbyname(socket.gethostname())
        return host, find_free_port()

    # ------------------------------------------------------------------ set-up
    def init_worker(self, master_addr: str, master_port: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        arr = self.cfg.actor_rollout_ref
        self.device_type = resolve_device_type(self.cfg.trainer.device)
        if self.device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        self.device = torch.device(self.device_type)
        tokenizer = AutoTokenizer.from_pretrained(arr.model.path)
        self.pad_token_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
        os.environ.update(RANK=str(self.rank), LOCAL_RANK="0", WORLD_SIZE=str(self.world_size),
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        dist.init_process_group(
            backend_for(self.device_type), init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank, world_size=self.world_size,
        )
        # vLLM joins the existing world ("external_launcher": every rank runs its own engine) instead
        # of creating a default process group of its own. Build it before seeding: it re-seeds RNGs.
        self.rollout = build_rollout_engine(
            arr.rollout.name, arr.model.path, dtype=arr.rollout.dtype, seed=self.cfg.trainer.seed + self.rank,
            max_model_len=self.cfg.data.max_prompt_length + self.cfg.data.max_response_length,
            **self._engine_kwargs(),
        )
        seed_everything(self.cfg.trainer.seed)
        self.dims = build_parallel_dims(arr.actor.ulysses_sequence_parallel_size, self.device_type)
        self.actor = self._build_engine(trainable=True)
        self.ref = self._build_engine(trainable=False) if arr.actor.use_kl_loss else None
        log.info("worker ready in %.1fs (dp=%d sp=%d)", time.perf_counter() - t0, self.dims.dp_size, self.dims.sp_size)
        return {"rank": self.rank, "dp_rank": self.dims.dp_rank, "sp_rank": self.dims.sp_rank,
                "init_s": time.perf_counter() - t0, "torch_threads": torch.get_num_threads()}

    def _engine_kwargs(self) -> dict[str, Any]:
        r = self.cfg.actor_rollout_ref.rollout
        if r.name == "vllm":
            return {"enforce_eager": r.enforce_eager, "gpu_memory_utilization": r.gpu_memory_utilization,
                    "cpu_kvcache_space_gib": r.cpu_kvcache_space_gib, "distributed_executor_backend": "external_launcher"}
        return {"device": self.device_type}

    def _build_engine(self, trainable: bool) -> FSDPEngine:
        arr = self.cfg.actor_rollout_ref
        optim = arr.actor.optim
        return FSDPEngine(
            arr.model.path, self.dims, self.device, dtype=arr.model.dtype, trainable=trainable,
            lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay, warmup_steps=optim.warmup_steps,
            grad_clip=optim.grad_clip,
            logprob_chunk_size=arr.actor.logprob_chunk_size,
            gradient_checkpointing=arr.model.enable_gradient_checkpointing and trainable,
        )

    # ------------------------------------------------------------------ rollout (per rank, not collective)
    def generate(self, prompts: Batch, sampling: dict[str, Any]) -> Batch:
        """Sample `n` responses per prompt; rows of one prompt are contiguous and share its meta."""
        if sampling.get("seed") is not None:
            # Distinct, far-apart streams per rank: vLLM derives per-sample seeds from consecutive values.
            sampling = {**sampling, "seed": int(sampling["seed"]) + 1_000_003 * self.rank}
        cfg = SamplingConfig(**sampling)
        prompt_ids: list[list[int]] = prompts.meta["prompt_ids"]
        self.rollout.wake_up()
        out = self.rollout.generate(prompt_ids, cfg)
        # Free the engine's accelerator memory for training (no-op on CPU); sync_weights wakes it.
        self.rollout.sleep()
        rows = build_rollout_rows(
            [prompt_ids[i] for i in out.prompt_index], out.response_ids, out.response_logprobs,
            self.cfg.data.max_prompt_length, cfg.max_tokens, self.pad_token_id,
        )
        meta = {k: [v[i] for i in out.prompt_index] for k, v in prompts.meta.items() if k != "prompt_ids"}
        return Batch.from_dict(rows, meta=meta)

    # ------------------------------------------------------------------ training (collective)
    def compute_old_logprobs(self, batch: Batch) -> Batch:
        micro = self.cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu
        lp = self.actor.compute_logprobs(batch, self.cfg.data.max_prompt_length, micro, self._temperature(batch))
        return Batch.from_dict({"old_logprobs": lp})

    def compute_ref_logprobs(self, batch: Batch) -> Batch:
        if self.ref is None:
            raise RuntimeError("reference model not built: actor_rollout_ref.actor.use_kl_loss=false")
        micro = self.cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu
        lp = self.ref.compute_logprobs(batch, self.cfg.data.max_prompt_length, micro, self._temperature(batch))
        return Batch.from_dict({"ref_logprobs": lp})

    def _temperature(self, batch: Batch) -> float:
        return float(batch.info.get("temperature", self.cfg.actor_rollout_ref.rollout.temperature))

    def update_actor(self, batch: Batch) -> dict[str, float]:
        """PPO epochs over mini-batches of this dp shard; metrics averaged over optimizer steps."""
        actor_cfg = self.cfg.actor_rollout_ref.actor
        loss_cfg = self._loss_config()
        n = self.cfg.actor_rollout_ref.rollout.n
        mini_rows = actor_cfg.ppo_mini_batch_size * n // self.dims.dp_size
        history: list[dict[str, float]] = []
        for _ in range(actor_cfg.ppo_epochs):
            for mini in batch.split(mini_rows):
                global_tokens = self._global_token_count(mini)
                loss_fn = make_actor_loss(loss_cfg, global_tokens)
                history.append(self.actor.train_step(
                    mini, self.cfg.data.max_prompt_length, actor_cfg.ppo_micro_batch_size_per_gpu,
                    self._temperature(batch), loss_fn,
                ))
        keys = history[0].keys()
        return {k if "/" in k else f"actor/{k}": sum(h[k] for h in history) / len(history) for k in keys}

    def _loss_config(self) -> ActorLossConfig:
        a = self.cfg.actor_rollout_ref.actor
        return ActorLossConfig(
            policy_loss=a.policy_loss,
            clip_ratio_low=a.clip_ratio_low if a.clip_ratio_low is not None else a.clip_ratio,
            clip_ratio_high=a.clip_ratio_high if a.clip_ratio_high is not None else a.clip_ratio,
            clip_ratio_c=a.clip_ratio_c, use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef,
            kl_loss_type=a.kl_loss_type, entropy_coeff=a.entropy_coeff,
        )

    def _global_token_count(self, mini: Batch) -> float:
        """Response tokens of the whole mini-batch: sp ranks hold identical rows, so reduce over dp only."""
        count = mini["response_mask"].sum().to(torch.float64).reshape(1)
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=self.dims.dp_group)
        return float(count.item())

    # ------------------------------------------------------------------ weights (collective)
    def sync_weights(self) -> dict[str, float]:
        """Push the actor's full weights into this rank's rollout engine, parameter by parameter."""
        t0 = time.perf_counter()
        dtype = DTYPES[self.cfg.actor_rollout_ref.rollout.dtype]
        self.rollout.wake_up()
        self.rollout.update_weights(self.actor.iter_full_params(dtype))
        return {"timing/weight_sync_s": time.perf_counter() - t0}

    def save_model(self, path: str) -> str:
        """Save the actor as a Hugging Face model directory (weights, config, tokenizer); collective."""
        self.actor.save_hf(path)
        if self.rank == 0:
            source = self.cfg.actor_rollout_ref.model.path
            AutoTokenizer.from_pretrained(source).save_pretrained(path)
            if os.path.exists(os.path.join(source, "generation_config.json")):  # stop ids for generation
                GenerationConfig.from_pretrained(source).save_pretrained(path)
        return path

    def actor_param_checksum(self) -> float:
        """Sum of |w| over the full actor weights (collective): lets tests see that training moved them."""
        total = 0.0
        for _, t in self.actor.iter_full_params(torch.float64):
            total += float(t.abs().sum())
        return total

    def rollout_prompt_logprobs(self, token_ids: list[int]) -> list[float | None]:
        self.rollout.wake_up()
        return self.rollout.prompt_logprobs(token_ids)

    def sp_self_check(self, batch: Batch) -> float:
        """Max |logprob(sp=k) - logprob(unsharded)| on `batch` (collective)."""
        return self.actor.sp_self_check(batch, self.cfg.data.max_prompt_length, self._temperature(batch))

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
