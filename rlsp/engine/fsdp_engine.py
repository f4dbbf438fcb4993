"""FSDP2 engine: one per model role (actor, reference, critic) on each rank; role-agnostic.

It owns a sharded head model (`rlsp.models.lm.TokenLogprobModel` for the policy,
`rlsp.models.value.ValueModel` for the critic — anything with their calling convention), its
optimizer and LR schedule, and the packed/sequence-parallel micro-batch path (degree 1 is the same
path with trivial groups). The role's layout (`ParallelDims`) decides everything: tensor parallelism
(applied first, on the tp mesh), FSDP2 over the other ranks (a whole model per rank that computes in its
own dtype stays a plain module whose gradients are summed once per step), and how a micro-batch's stream is split
(ring zigzag x Ulysses, plus tp slices with sequence-parallel activations). Callers give padded
rollout rows; the engine packs each micro-batch into one token stream, shards it, runs the head (and
backward), and gathers per-token results only when they must be returned to the driver. A loss
function receives whatever the head produced (a dict of this rank's per-token tensors) together with
the micro-batch.

`state_dict()` / `load_state_dict()` cover model, optimizer and LR schedule (sharded tensors, as
torch.distributed.checkpoint saves them); a partly frozen model (LoRA adapters on a frozen base)
contributes only its trainable parameters. They, and the full HF-named weights and gradients, live in
rlsp.engine.state (`EngineState`); a step's metric reductions and gradient clipping in
rlsp.engine.step_metrics.

Legend: B rows, P prompt width, R response width, T packed stream, S a rank's local tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from rlsp.data.batch import Batch
from rlsp.engine.adaptive_plan import quadratic_tokens
from rlsp.engine.fsdp_offload import build_offload_policy
from rlsp.engine.micro import MicroBatch, MicroPlan, merge_reported, plan_micro_batches, plan_rows, prepare_micro_batch
from rlsp.engine.moe_load import ExpertLoad
from rlsp.engine.offload import ActivationOffload
from rlsp.engine.optim import OptimSettings, build_optimizer
from rlsp.engine.parallelize import all_reduce_gradients, parallelize, replicated
from rlsp.engine.reference import meta_skeleton, run_skeleton
from rlsp.engine.router_aux import RouterAux
from rlsp.engine.router_replay import ROUTE_DTYPE, ROUTES_KEY, RouterReplay, infer_routing, replaying_rows
from rlsp.engine.state import EngineState
from rlsp.engine.step_metrics import accumulate_metrics, clip_grad_norm, max_over_ranks, reduce_metrics, sp_metrics
from rlsp.engine.stream import stream_to_last_token, stream_to_response
from rlsp.models.family_checks import num_heads
from rlsp.models.lora_experts import expert_parallel_problem
from rlsp.parallel.expert_parallel import apply_expert_parallel, expert_sharded_names
from rlsp.parallel.mesh import ParallelDims
from rlsp.parallel.tensor_parallel import apply_tensor_parallel
from rlsp.parallel.tp_checks import local_head_counts

# loss_fn(head outputs {name: local [S] tensor}, micro) -> (loss share of the global mean, metric shares)
LossFn = Callable[[dict[str, torch.Tensor], MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def assert_sp_matches(max_abs_diff: float, tol: float, layout: str, what: str = "logprob") -> None:
    """Stop a run whose sharded forward (`layout` names its degrees) disagrees with the unsharded one."""
    if not max_abs_diff <= tol:  # also catches NaN
        raise RuntimeError(
            f"sequence-parallel self-check failed: max |{what}({layout}) - {what}(unsharded)| = "
            f"{max_abs_diff:.3g} > tolerance {tol:g} (trainer.sp_self_check_tol); refusing to train on a "
            "broken head layout or all-to-all"
        )


class FSDPEngine(EngineState):
    """`module` is an unsharded head model (on `device`, master dtype); the engine shards it in place
    (or keeps it whole where `rlsp.engine.parallelize.replicated` says FSDP has nothing to do)."""

    def __init__(self, module: nn.Module, dims: ParallelDims, device: torch.device, *,
                 compute_dtype: torch.dtype = torch.float32, optim: OptimSettings | None = None,
                 activation_offload: bool = False, param_offload: bool = False, router_replay: bool = False,
                 router_aux_coef: float = 0.0) -> None:  # > 0: + MoE router aux loss x it (rlsp.engine.router_aux)
        """`param_offload`: FSDP2's CPUOffloadPolicy (shards, gradients, optimizer state in host memory);
        `router_replay`: MoE routing replay R2/R3 (rlsp.engine.router_replay: `infer_many(record_routes=True)`
        returns the routes, `infer_many(replay_routes=True)` and `backward_batch` replay the rows' `router_routes`)."""
        self.dims, self.device, self.compute_dtype = dims, device, compute_dtype
        self.config = config = module.decoder.config
        layout = dims.layout
        # Heads one rank's attention sees (a tp rank's share under tensor parallelism).
        self.num_q_heads, self.num_kv_heads = local_head_counts(config, layout.tp)
        # The HF-named parameter tree (policy: the causal LM; critic: backbone + value head).
        self.hf_root: nn.Module = getattr(module, "lm", module)
        # Tied: the output layer holds the input embedding's tensor (a vision-language model's text config may not say
        # so: Qwen2.5-VL keeps tie_word_embeddings on the top-level config only).
        head = getattr(self.hf_root, "lm_head", None)
        self.tied = head is not None and head.weight is self.hf_root.get_input_embeddings().weight
        # Tensor parallelism shards the layers in place: keep a weightless skeleton for the self-check.
        self.skeleton = meta_skeleton(module) if dims.tp_mesh is not None else None
        if dims.tp_mesh is not None:
            apply_tensor_parallel(module, dims.tp_mesh, layout.sequence_parallel)
        if dims.ep_group is not None:  # this rank's experts only, dispatched to by all-to-all
            if problem := expert_parallel_problem(module):  # peft's adapters on the fused experts (LoRA)
                raise ValueError(f"fsdp_config.expert_parallel_size={layout.ep}: {problem}")
            apply_expert_parallel(module, dims.ep_group)
        self.ep_names = expert_sharded_names(self.hf_root)  # {} without expert parallelism
        offload = build_offload_policy(param_offload, device)
        # A whole model per rank in its own dtype stays a plain module; its gradients are summed by the
        # engine once per step (rlsp.engine.parallelize).
        self.replicated = replicated(module, dims, compute_dtype, offload)
        self.module = module if self.replicated else parallelize(module, dims, compute_dtype, offload)
        self.optim = optim
        # tokens per expert of a trainable MoE model's forwards (actor metrics; rlsp.engine.moe_load)
        self.expert_load = ExpertLoad(module if optim is not None else None, device)
        self.router_replay = RouterReplay(module, getattr(config, "model_type", "")) if router_replay else None
        self.router_aux = RouterAux(self.module, self.hf_root, router_aux_coef if optim is not None else 0.0)
        self.offload = ActivationOffload(activation_offload, self.module, device)  # rlsp.engine.offload
        if optim is None:
            self.module.requires_grad_(False)
            self.optimizer, self.scheduler = None, None
        else:
            self.optimizer, self.scheduler = build_optimizer(self.module, optim)

    # ----------------------------------------------------------------- micro-batches
    def prepare(self, rows: Batch, prompt_len: int, degree: int | None = None) -> MicroBatch:
        return prepare_micro_batch(rows, prompt_len, self.dims, self.num_q_heads, self.num_kv_heads,
                                   tp=getattr(self.module, "tp_info", None), degree=degree)

    def forward(self, micro: MicroBatch, **head_kwargs: Any) -> dict[str, torch.Tensor]:
        packed = micro.packed
        return self.module(
            micro.local(packed.input_ids).to(self.device),
            micro.local(packed.position_ids).to(self.device),
            micro.local(packed.labels).to(self.device),
            sp_context=micro.ctx,
            **micro.multi_modal_kwargs(),  # the rows' images (vision-language models; rlsp.models.vision_lm)
            **head_kwargs,
        )

    def _to_rows(self, values: torch.Tensor, micro: MicroBatch, last_token: bool = False) -> torch.Tensor:
        """This rank's head outputs -> response rows [B, R] (zeros on padding), or with `last_token` each
        row's value at its last real token [B, 1] (a sequence score); gathered over the ranks that split
        the stream."""
        values_T = micro.gather(values.detach().float()).cpu()
        if last_token:
            return stream_to_last_token(values_T, micro.packed)[:, None]
        rows_BR = stream_to_response(values_T, micro.packed, micro.prompt_len, micro.response_len)
        return rows_BR * micro.rows["response_mask"]

    def _micro_batches(self, batch: Batch, micro_size: int, max_tokens: int | None) -> list[tuple[MicroPlan, Batch]]:
        plans = plan_micro_batches(batch, micro_size, max_tokens, self.dims, quadratic_tokens(self.config))
        return [(plan, plan_rows(batch, plan)) for plan in plans]

    def infer(self, batch: Batch, prompt_len: int, micro_size: int, key: str, max_tokens: int | None = None,
              *, last_token: bool = False, **head_kwargs: Any) -> torch.Tensor:
        """The head's output `key` for every response token, [B, R] (zeros on padding), or with
        `last_token` at each row's last real token, [B] (a reward model's score); collective.
        Micro-batches hold `micro_size` rows, or up to `max_tokens` tokens per rank when given."""
        return self.infer_many(batch, prompt_len, micro_size, (key,), max_tokens, last_token=last_token,
                               **head_kwargs)[key]

    @torch.no_grad()
    def infer_many(self, batch: Batch, prompt_len: int, micro_size: int, keys: tuple[str, ...],
                   max_tokens: int | None = None, *, last_token: bool = False, record_routes: bool = False,
                   replay_routes: bool = False, **head_kwargs: Any) -> dict[str, torch.Tensor]:
        """`infer` for several head outputs of the same forward passes: {key: [B, R] (or [B])}; with
        `record_routes` also the MoE routes under ROUTES_KEY, [B, P+R, L, K]; `replay_routes` routes by the rows' (R3)."""
        self.module.eval()
        width = 1 if last_token else batch["input_ids"].shape[1] - prompt_len
        outs = {key: torch.zeros(len(batch), width) for key in keys}
        adaptive = False
        for plan, rows in self._micro_batches(batch, micro_size, max_tokens):
            micro = self.prepare(rows, prompt_len, plan.degree)
            with self.expert_load.recording(micro), infer_routing(self.router_replay, micro, record_routes, replay_routes):
                head = self.forward(micro, **head_kwargs)
            values = {key: self._to_rows(head[key], micro, last_token) for key in keys}
            if record_routes:  # int32 rows: merge_reported sums them
                values[ROUTES_KEY] = self.router_replay.recorded_rows(micro).to(torch.int32)
                outs.setdefault(ROUTES_KEY, values[ROUTES_KEY].new_zeros((len(batch), *values[ROUTES_KEY].shape[1:])))
            adaptive |= plan.degree is not None
            if plan.reports:
                for key in values:
                    outs[key][plan.rows] = values[key]
        if adaptive:
            merge_reported(outs, self.dims)
        if record_routes:
            outs[ROUTES_KEY] = outs[ROUTES_KEY].to(ROUTE_DTYPE)
        return {key: out[:, 0] if last_token and key != ROUTES_KEY else out for key, out in outs.items()}

    @torch.no_grad()
    def sp_self_check(self, rows: Batch, prompt_len: int, key: str, last_token: bool = False,
                      **head_kwargs: Any) -> float:
        """Max |difference| of head output `key` between the sharded forward (every degree of the
        layout) and an unsharded one over the whole stream with all heads; collective.

        Every rank runs both forwards (FSDP needs matching collectives), so any head-layout,
        all-to-all, ring or tensor-parallel bug shows up here. Without tensor parallelism the
        unsharded forward runs the engine's own module on a trivial context; with it, a skeleton of
        the model with the gathered full weights (rlsp.engine.reference).
        """
        self.module.eval()
        full = prepare_micro_batch(rows, prompt_len, None, *num_heads(self.config))
        b = self._to_rows(self._unsharded_forward(full, **head_kwargs)[key], full, last_token)
        layout, worst = self.dims.layout, 0.0
        for degree in layout.ulysses_degrees if layout.adaptive else (None,):  # adaptive: every degree
            sharded = self.prepare(rows, prompt_len, degree)
            a = self._to_rows(self.forward(sharded, **head_kwargs)[key], sharded, last_token)
            worst = max(worst, float((a - b).abs().max()) if a.numel() else 0.0)
        return worst

    def _unsharded_forward(self, micro: MicroBatch, **head_kwargs: Any) -> dict[str, torch.Tensor]:
        if self.skeleton is None:
            return self.forward(micro, **head_kwargs)
        prefix = "lm." if self.hf_root is not self.module else ""
        params = {prefix + name: t for name, t in self.iter_full_params(self.compute_dtype)}
        packed = micro.packed
        inputs = tuple(micro.local(x).to(self.device) for x in (packed.input_ids, packed.position_ids, packed.labels))
        return run_skeleton(self.skeleton, params, inputs, {"sp_context": micro.ctx, **head_kwargs})

    # ----------------------------------------------------------------- training
    def train_step(self, batch: Batch, prompt_len: int, micro_size: int, loss_fn: LossFn,
                   max_tokens: int | None = None, **head_kwargs: Any) -> dict[str, float]:
        """One optimizer step over `batch` (this rank's share of a mini-batch).

        Besides the loss metrics it reports where the step's time went on the slowest rank:
        `time_forward_s_max`, `time_backward_s_max` (FSDP collectives included) and
        `time_optimizer_s_max` (gradient clipping + optimizer step)."""
        if self.optimizer is None:
            raise RuntimeError("train_step called on a frozen engine (built without optimizer settings)")
        self.optimizer.zero_grad(set_to_none=True)
        out = self.backward_batch(batch, prompt_len, micro_size, loss_fn, max_tokens, **head_kwargs)
        t0 = time.perf_counter()
        grad_norm = self._clip_grad()
        out["lr"] = self.optimizer.param_groups[0]["lr"]
        if torch.isfinite(grad_norm):
            self.optimizer.step()
            self.scheduler.step()
        out["grad_norm"] = float(grad_norm)
        out["time_optimizer_s_max"] = max_over_ranks(time.perf_counter() - t0)
        return out

    def backward_batch(self, batch: Batch, prompt_len: int, micro_size: int, loss_fn: LossFn,
                       max_tokens: int | None = None, **head_kwargs: Any) -> dict[str, float]:
        """Accumulate gradients of `loss_fn` over the micro-batches of `batch`; returns reduced metrics."""
        self.module.train()
        loss_fn = self.router_aux.wrap(loss_fn, batch, self.dims.dp_group)  # + the MoE router auxiliary loss
        sums: dict[str, torch.Tensor] = {}
        sp_local = torch.zeros(4, dtype=torch.float64)  # local tokens, pad tokens, a2a seconds, total seconds
        timing = {"time_forward_s_max": torch.zeros((), dtype=torch.float64),
                  "time_backward_s_max": torch.zeros((), dtype=torch.float64)}
        offloaded = 0  # the most bytes one micro-batch's forward moved to host memory
        for plan, rows in self._micro_batches(batch, micro_size, max_tokens):
            t0 = time.perf_counter()
            micro = self.prepare(rows, prompt_len, plan.degree)
            # the forward only: backward's recomputations keep their tensors and count no routing again
            with replaying_rows(self.router_replay, micro):  # R2: the recorded routes, recomputations in backward included
                with self.offload() as stats, self.expert_load.recording(micro):
                    loss, metrics = loss_fn(self.forward(micro, **head_kwargs), micro)
                offloaded = max(offloaded, stats.bytes)
                t1 = time.perf_counter()
                loss.backward()
            timing["time_forward_s_max"] += t1 - t0
            timing["time_backward_s_max"] += time.perf_counter() - t1
            accumulate_metrics(sums, metrics)
            pad = micro.packed.num_pad * micro.out_len / micro.packed.total_len
            sp_local += torch.tensor([micro.out_len, pad,
                                      micro.ctx.stats.a2a_seconds, time.perf_counter() - t0], dtype=torch.float64)
        if self.replicated and self.dims.world_size > 1:  # FSDP reduces in backward; a replicated model here, once
            t0 = time.perf_counter()
            all_reduce_gradients(self.module)
            timing["time_backward_s_max"] += time.perf_counter() - t0
        out = {**reduce_metrics({**sums, **timing}, self.dims.layout.token_replicas),
               **sp_metrics(sp_local, self.dims.world_size)}
        if self.offload.enabled:  # device memory the offload freed at its peak, on the rank that freed most
            out["perf/activation_offload_bytes"] = max_over_ranks(float(offloaded))
        return out

    def _clip_grad(self) -> torch.Tensor:
        """The step's gradient norm before clipping to optim.grad_clip (a method: benchmarks watch it)."""
        return clip_grad_norm(self.module, self.optim.grad_clip if self.optim is not None else 0.0, self.device)
