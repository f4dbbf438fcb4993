"""FSDP2 engine: one per model role (actor, reference) on each rank.

It owns the sharded `TokenLogprobModel`, its optimizer, and the packed/sequence-parallel micro-batch
path (sp=1 is the same path with a trivial group). Callers give padded rollout rows; the engine packs
each micro-batch into one token stream, shards it across the sp group, runs forward (and backward),
and gathers per-token results only when they must be returned to the driver.

Gradients are SUMMED across all ranks (FSDP division turned off): each rank's loss is already its
share of the global token-mean, so the reduced gradient is exact for any dp x sp x micro-batching.

Legend: B rows, P prompt width, R response width, T packed stream, S = T / sp local shard.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.fsdp import FSDPModule, fully_shard

from rlsp.data.batch import Batch
from rlsp.data.packing import PackedBatch, pack_sequences
from rlsp.engine.stream import response_to_stream, stream_to_response
from rlsp.models.lm import TokenLogprobModel
from rlsp.models.loading import load_causal_lm, num_heads
from rlsp.parallel.mesh import ParallelDims
from rlsp.parallel.ulysses import SPContext, build_sp_context, gather_from_ranks, shard_for_rank

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class MicroBatch:
    """One packed micro-batch as seen by this rank."""

    rows: Batch
    packed: PackedBatch
    ctx: SPContext
    prompt_len: int
    response_len: int

    def local(self, values_T: torch.Tensor) -> torch.Tensor:
        return shard_for_rank(values_T, self.ctx)

    def response_local(self, key: str) -> torch.Tensor:
        """This rank's shard of a [B, R] response field of the rows, laid out like the logprobs."""
        return self.local(response_to_stream(self.rows[key], self.packed, self.prompt_len))


def assert_sp_matches(max_abs_diff: float, tol: float, sp_size: int) -> None:
    """Stop a run whose sequence-parallel forward disagrees with the unsharded one."""
    if not max_abs_diff <= tol:  # also catches NaN
        raise RuntimeError(
            f"sequence-parallel self-check failed: max |logprob(sp={sp_size}) - logprob(sp=1)| = "
            f"{max_abs_diff:.3g} > tolerance {tol:g} (trainer.sp_self_check_tol); refusing to train on a "
            "broken head layout or all-to-all"
        )


# loss_fn(logprobs_S, entropy_S, micro) -> (loss contribution to the global mean, metric contributions)
LossFn = Callable[[torch.Tensor, torch.Tensor, MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class FSDPEngine:
    def __init__(
        self,
        model_path: str,
        dims: ParallelDims,
        device: torch.device,
        *,
        dtype: str = "float32",
        trainable: bool = True,
        lr: float = 1e-6,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        grad_clip: float = 1.0,
        logprob_chunk_size: int = 1024,
        gradient_checkpointing: bool = False,
    ) -> None:
        self.dims, self.device, self.grad_clip = dims, device, grad_clip
        lm = load_causal_lm(model_path, dtype=DTYPES[dtype])
        if gradient_checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.config = lm.config
        self.num_q_heads, self.num_kv_heads = num_heads(lm.config)
        self.tied = bool(getattr(lm.config, "tie_word_embeddings", False))
        lm.to(device)
        self.module = TokenLogprobModel(lm, chunk_size=logprob_chunk_size)
        self._apply_fsdp2()
        if not trainable:
            self.module.requires_grad_(False)
        self.optimizer = (
            torch.optim.AdamW(self.module.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)
            if trainable
            else None
        )
        self.scheduler = (
            torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: min(1.0, (step + 1) / max(1, warmup_steps)))
            if self.optimizer is not None
            else None
        )

    def _apply_fsdp2(self) -> None:
        mesh = self.dims.fsdp_mesh
        for layer in self.module.lm.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.module, mesh=mesh)
        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
                m.set_gradient_divide_factor(1.0)

    # ----------------------------------------------------------------- micro-batches
    def _sp_group(self) -> dist.ProcessGroup | None:
        return self.dims.sp_group if self.dims.sp_size > 1 else None

    def prepare(self, rows: Batch, prompt_len: int) -> MicroBatch:
        packed = pack_sequences(rows["input_ids"], rows["attention_mask"], pad_to_multiple=self.dims.sp_size)
        ctx = build_sp_context(self._sp_group(), packed, self.num_q_heads, self.num_kv_heads)
        response_len = rows["input_ids"].shape[1] - prompt_len
        return MicroBatch(rows=rows, packed=packed, ctx=ctx, prompt_len=prompt_len, response_len=response_len)

    def forward(self, micro: MicroBatch, temperature: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        packed = micro.packed
        return self.module(
            micro.local(packed.input_ids).to(self.device),
            micro.local(packed.position_ids).to(self.device),
            micro.local(packed.labels).to(self.device),
            sp_context=micro.ctx,
            temperature=temperature,
            with_entropy=with_entropy,
        )

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch, prompt_len: int, micro_size: int, temperature: float) -> torch.Tensor:
        """Per-response-token logprobs [B, R] (zeros on padding), gathered over the sp group."""
        self.module.eval()
        outs = []
        for rows in batch.split(micro_size):
            micro = self.prepare(rows, prompt_len)
            logprobs_S, _ = self.forward(micro, temperature, with_entropy=False)
            logprobs_T = gather_from_ranks(logprobs_S.float(), micro.ctx).cpu()
            resp_BR = stream_to_response(logprobs_T, micro.packed, prompt_len, micro.response_len)
            outs.append(resp_BR * rows["response_mask"])
        return torch.cat(outs, dim=0)

    @torch.no_grad()
    def sp_self_check(self, rows: Batch, prompt_len: int, temperature: float) -> float:
        """Max |logprob| difference between the sp-sharded forward and an unsharded one (collective).

        Every rank runs both forwards (FSDP needs matching collectives); the unsharded one uses a
        trivial sp context over the full stream, so any head-layout or all-to-all bug shows up here.
        """
        self.module.eval()
        sharded = self.prepare(rows, prompt_len)
        lp_S, _ = self.forward(sharded, temperature, with_entropy=False)
        lp_T = gather_from_ranks(lp_S.float(), sharded.ctx).cpu()
        packed = pack_sequences(rows["input_ids"], rows["attention_mask"], pad_to_multiple=1)
        ctx = build_sp_context(None, packed, self.num_q_heads, self.num_kv_heads)
        full = MicroBatch(rows=rows, packed=packed, ctx=ctx, prompt_len=prompt_len, response_len=sharded.response_len)
        ref_T, _ = self.forward(full, temperature, with_entropy=False)
        mask = rows["response_mask"]
        a = stream_to_response(lp_T, sharded.packed, prompt_len, sharded.response_len) * mask
        b = stream_to_response(ref_T.float().cpu(), packed, prompt_len, sharded.response_len) * mask
        return float((a - b).abs().max()) if a.numel() else 0.0

    # ----------------------------------------------------------------- training
    def train_step(self, batch: Batch, prompt_len: int, micro_size: int, temperature: float, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over `batch` (this rank's share of a mini-batch)."""
        assert self.optimizer is not None, "train_step called on a frozen engine"
        self.optimizer.zero_grad(set_to_none=True)
        out = self.backward_batch(batch, prompt_len, micro_size, temperature, loss_fn)
        grad_norm = self._clip_grad()
        out["lr"] = self.optimizer.param_groups[0]["lr"]
        if torch.isfinite(grad_norm):
            self.optimizer.step()
            self.scheduler.step()
        out["grad_norm"] = float(grad_norm)
        return out

    def backward_batch(self, batch: Batch, prompt_len: int, micro_size: int, temperature: float, loss_fn: LossFn) -> dict[str, float]:
        """Accumulate gradients of `loss_fn` over the micro-batches of `batch`; returns reduced metrics."""
        self.module.train()
        sums: dict[str, torch.Tensor] = {}
        sp_local = torch.zeros(4, dtype=torch.float64)  # local tokens, pad tokens, a2a seconds, total seconds
        for rows in batch.split(micro_size):
            t0 = time.perf_counter()
            micro = self.prepare(rows, prompt_len)
            logprobs_S, entropy_S = self.forward(micro, temperature, with_entropy=True)
            loss, metrics = loss_fn(logprobs_S, entropy_S, micro)
            loss.backward()
            for key, val in metrics.items():
                sums[key] = sums.get(key, 0.0) + val.detach().float().cpu()
            sp_local += torch.tensor([micro.ctx.local_len, micro.packed.num_pad / self.dims.sp_size,
                                      micro.ctx.stats.a2a_seconds, time.perf_counter() - t0], dtype=torch.float64)
        return {**self._reduce_metrics(sums), **self._sp_metrics(sp_local)}

    def _sp_metrics(self, local: torch.Tensor) -> dict[str, float]:
        """Rank averages of sequence-parallel load: tokens per rank, padding share, all-to-all time share."""
        dist.all_reduce(local, op=dist.ReduceOp.SUM)
        tokens, pad, a2a_s, total_s = (local / self.dims.world_size).tolist()
        return {"sp/tokens_per_rank": tokens, "sp/pad_fraction": pad / max(tokens, 1.0),
                "sp/a2a_time_share": a2a_s / max(total_s, 1e-9)}

    def iter_full_grads(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full gradients (collective); for checks and tests."""
        for name, param in self.module.lm.named_parameters():
            if param.grad is not None:
                g = param.grad
                yield name, (g.full_tensor() if hasattr(g, "full_tensor") else g).detach()

    def _clip_grad(self) -> torch.Tensor:
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=self.grad_clip if self.grad_clip > 0 else float("inf"))
        full = getattr(norm, "full_tensor", None)
        return (full() if full is not None else norm).detach().float().cpu()

    def _reduce_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """Metric contributions are shares of a global mean: summing over all ranks gives the value."""
        if not sums:
            return {}
        keys = sorted(sums)
        vec = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64) for k in keys])
        dist.all_reduce(vec, op=dist.ReduceOp.SUM)
        return {k: float(v) for k, v in zip(keys, vec.tolist())}

    # ----------------------------------------------------------------- weights
    def iter_full_params(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors, one parameter at a time (collective: every rank must iterate)."""
        for name, param in self.module.lm.named_parameters():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            full = full.detach().to(dtype or full.dtype)
            yield name, full
            if self.tied and name == "model.embed_tokens.weight":
                yield "lm_head.weight", full

    def save_hf(self, path: str) -> None:
        """Write the full weights + config as a Hugging Face checkpoint (collective; rank 0 writes)."""
        state = {name: t.cpu().contiguous() for name, t in self.iter_full_params()}
        if dist.get_rank() != 0:
            return
        if self.tied:
            state.pop("lm_head.weight", None)  # tied: the embedding is the output layer
        os.makedirs(path, exist_ok=True)
        save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        self.config.save_pretrained(path)
