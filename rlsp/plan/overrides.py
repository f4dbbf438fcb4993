"""Hydra overrides of a plan: the verl-named keys `python -m rlsp.main` takes (rlsp/config/schema.py).

Memory options whose keys the schema does not declare (tiled MLP, activation offload in versions
without them) are neither enumerated nor emitted; `schema_has` decides. Batch sizes are chosen so
that validation accepts them (prompts divisible by the workers, mini-batches by the dp ranks).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from rlsp.config.schema import RLSPConfig
from rlsp.plan.memory import GIB
from rlsp.plan.search import Plan, Request

TILED_KEY = "actor_rollout_ref.model.tiled_mlp.num_shards"
OFFLOAD_KEY = "actor_rollout_ref.model.enable_activation_offload"
PARAM_OFFLOAD_KEY = "actor_rollout_ref.actor.fsdp_config.param_offload"
LEAN_NORM_KEY = "actor_rollout_ref.model.lean_rmsnorm"


def schema_has(key: str) -> bool:
    """Whether the dotted `key` is declared in the config schema."""
    node: typing.Any = RLSPConfig
    for part in key.split("."):
        if not dataclasses.is_dataclass(node):
            return False
        hints = typing.get_type_hints(node)
        if part not in hints:
            return False
        fld = {f.name: f for f in dataclasses.fields(node)}[part]
        factory = fld.default_factory
        node = factory if dataclasses.is_dataclass(factory) else hints[part]
    return True


@dataclass(frozen=True)
class RunShape:
    """What the run trains on besides the layout: model path, lengths, batch sizes, algorithm."""

    model_path: str
    prompt_len: int
    response_len: int
    train_batch_size: int
    mini_batch_size: int
    rollout_n: int
    algo: str  # grpo | ppo

    @property
    def estimator(self) -> str:
        return "gae" if self.algo == "ppo" else "grpo"


def batch_sizes(world: int, dp: int, rollout_n: int, requested: int | None) -> tuple[int, int]:
    """(train_batch_size, ppo_mini_batch_size): the requested batch (else the smallest multiple of the
    workers >= 16) and the largest mini-batch <= 16 that divides it and splits over the dp ranks."""
    batch = requested or -(-16 // world) * world
    if batch % world:
        raise ValueError(f"--train-batch-size={batch} must be a multiple of the {world} GPUs "
                         "(prompts are split over every worker for generation)")
    for mini in range(min(16, batch), 0, -1):
        if batch % mini == 0 and (mini * rollout_n) % dp == 0:
            return batch, mini
    return batch, batch


def self_check_fits(req: Request, plan: Plan, run: RunShape) -> bool:
    """Whether the start-up self-check (an unsharded forward of a dp rank's whole batch next to the
    sharded one, rlsp.engine.fsdp_engine.FSDPEngine.sp_self_check) fits; irrelevant at sp = tp = 1."""
    lay, shape, e = plan.layout, req.shape, req.dtype_bytes
    if lay.sp_size == 1 and lay.tp == 1:
        return True
    tokens = run.train_batch_size * run.rollout_n // lay.dp_size * req.seq_len
    per_token = 3 * shape.hidden * e + 2 * (shape.q_heads + 2 * shape.kv_heads) * shape.head_dim * e
    per_token += 3 * shape.intermediate * e
    head = req.logprob_chunk * shape.vocab * (8 + e)
    skeleton = shape.params * e if lay.tp > 1 else 0.0  # full weights for the unsharded reference
    state = sum(v for k, v in plan.memory.terms.items() if k.endswith(("state", "gradients")))
    return state + tokens * per_token + head + skeleton <= req.cluster.usable


def _degrees(prefix: str, plan: Plan) -> list[str]:
    lay = plan.layout
    return [f"{prefix}.ulysses_sequence_parallel_size={lay.ulysses}",
            f"{prefix}.ring_sequence_parallel_size={lay.ring}",
            f"{prefix}.tensor_model_parallel_size={lay.tp}",
            f"{prefix}.sequence_parallel={str(lay.sequence_parallel).lower()}"]


def _model_options(prefix: str, plan: Plan) -> list[str]:
    s = plan.settings
    out = [f"{prefix}.enable_gradient_checkpointing={str(s.checkpointing).lower()}"]
    if schema_has(f"{prefix}.enable_activation_offload"):
        out.append(f"{prefix}.enable_activation_offload={str(s.activation_offload).lower()}")
    if schema_has(f"{prefix}.tiled_mlp.num_shards"):
        out.append(f"{prefix}.tiled_mlp.enabled={str(bool(s.tiled_mlp_shards)).lower()}")
        if s.tiled_mlp_shards:
            out.append(f"{prefix}.tiled_mlp.num_shards={s.tiled_mlp_shards}")
    if schema_has(f"{prefix}.lean_rmsnorm"):
        out.append(f"{prefix}.lean_rmsnorm={str(s.lean_norm).lower()}")
    return out


def _offload(plan: Plan, critic: bool) -> list[str]:
    """FSDP parameter offload for every role (CPUOffloadPolicy: the trainable roles' optimizer state goes
    with their parameters, so optimizer_offload says so too)."""
    on = str(plan.settings.param_offload).lower()
    prefixes = ["actor_rollout_ref.actor.fsdp_config"] + ["critic.model.fsdp_config"] * critic
    out = [f"{p}.{key}={on}" for p in prefixes for key in ("param_offload", "optimizer_offload")]
    return out + [f"actor_rollout_ref.ref.fsdp_config.param_offload={on}"]


def overrides(req: Request, plan: Plan, run: RunShape) -> list[str]:
    """key=value overrides of `plan` for `python -m rlsp.main --config-name grpo` (or ppo)."""
    arr, b, size = "actor_rollout_ref", plan.settings.budget, plan.layout.fsdp_size
    dtype = "bfloat16" if req.dtype_bytes == 2 else "float32"
    out = [f"{arr}.model.path={run.model_path}", f"algorithm.adv_estimator={run.estimator}",
           f"trainer.nnodes={req.cluster.nodes}", f"trainer.n_gpus_per_node={req.cluster.gpus_per_node}",
           f"data.max_prompt_length={run.prompt_len}", f"data.max_response_length={run.response_len}",
           f"data.train_batch_size={run.train_batch_size}", f"{arr}.rollout.n={run.rollout_n}",
           f"{arr}.actor.ppo_mini_batch_size={run.mini_batch_size}",
           f"{arr}.model.dtype={dtype}", f"{arr}.rollout.dtype={dtype}", *_model_options(f"{arr}.model", plan),
           *_degrees(f"{arr}.actor", plan), f"{arr}.actor.fsdp_config.fsdp_size={size}",
           f"{arr}.ref.fsdp_config.fsdp_size={size}",
           f"{arr}.actor.use_dynamic_bsz=true", f"{arr}.actor.ppo_max_token_len_per_gpu={b}",
           f"{arr}.ref.log_prob_use_dynamic_bsz=true", f"{arr}.ref.log_prob_max_token_len_per_gpu={b}",
           f"{arr}.rollout.log_prob_use_dynamic_bsz=true", f"{arr}.rollout.log_prob_max_token_len_per_gpu={b}",
           f"{arr}.actor.logprob_chunk_size={req.logprob_chunk}"]
    if schema_has(PARAM_OFFLOAD_KEY):
        out += _offload(plan, run.algo == "ppo")
    if not req.reference:  # actor only: the reference is placed for neither KL term
        out += [f"{arr}.actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false"]
    if run.algo == "ppo":
        out += [*_degrees("critic", plan), f"critic.model.fsdp_config.fsdp_size={size}",
                *_model_options("critic.model", plan), f"critic.ppo_mini_batch_size={run.mini_batch_size}",
                "critic.use_dynamic_bsz=true", f"critic.ppo_max_token_len_per_gpu={b}",
                f"critic.forward_max_token_len_per_gpu={b}"]
    if not self_check_fits(req, plan, run):
        out.append("trainer.sp_self_check=false")
    return out


def rollout_note(req: Request, plan: Plan) -> str | None:
    """The colocated vLLM engine holds the whole model on every GPU (rlsp's rollout has no tensor
    parallelism); say so when its weights alone leave no room next to the training state."""
    weights = req.shape.params * req.dtype_bytes
    state = sum(v for k, v in plan.memory.terms.items() if k.endswith(("state", "gradients")))
    if weights + state <= req.cluster.usable:
        return None
    return (f"rollout: each GPU's vLLM engine holds the whole model ({weights / GIB:.1f} GiB in the compute dtype) "
            f"next to {state / GIB:.1f} GiB of training state, over the {req.cluster.usable / GIB:.1f} GiB usable; "
            "this version's rollout has no tensor parallelism, so the plan covers training only")
