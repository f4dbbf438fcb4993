"""The actor's MoE router auxiliary loss (rlsp.engine.router_aux) is transformers' own, and Ulysses keeps it exact.

One rank: for tiny qwen3_moe, mixtral, olmoe, qwen2_moe, gpt_oss, qwen3_next and qwen3_5_moe_text models
(tests/tiny_moe.py, tiny_gpt_oss.py, tiny_linear.py), the engine's
`actor/router_aux_loss` of one micro-batch equals `model(..., output_router_logits=True).aux_loss` of the same
rows (one unpadded row, and the padded rollout batch with its attention mask: padding is left out alike), and with
a policy loss of zero the engine's gradient is the coefficient times the gradient of transformers' aux_loss, every
element (bounds: tests/tolerances.py). qwen3_moe at Ulysses 2, Ulysses 2 x ring 2, Ulysses 2 with gradient
checkpointing and EP 2: the full actor loss plus the auxiliary term gives the metrics, every gradient and the AdamW
step of one rank with the same micro-batches; the actor role turns it on from verl's model.override_config.
"""

from __future__ import annotations

import pytest
import torch
from _launch import layout_dims, run_distributed
from test_fsdp_engine import LOSS, LR, METRICS, TOKENS, P, R, _assert_same_step, _role_update, _rollout_batch
from test_moe_exact import margin_checked_batch
from tiny_moe import write_exact_moe, write_tiny_moe
from tolerances import assert_grads_close, model_rtol, scalar_tol

from rlsp.config.layout import RoleLayout, World
from rlsp.data.batch import Batch
from rlsp.engine.fsdp_engine import FSDPEngine
from rlsp.engine.optim import OptimSettings
from rlsp.engine.router_aux import METRIC, aux_loss_coef, router_aux_errors
from rlsp.models.lm import TokenLogprobModel
from rlsp.models.loading import load_causal_lm
from rlsp.parallel.mesh import build_parallel_dims
from rlsp.workers.actor_loss import make_actor_loss
from rlsp.workers.ppo_loop import global_counts

pytestmark = pytest.mark.distributed
COEF = 0.5
FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe")
LINEAR_MOE = ("qwen3_next", "qwen3_5_moe_text")  # Gated DeltaNet + MoE (tests/tiny_linear.py)
VOCAB = 58  # the char tokenizer's, as tests/tiny_moe.py writes the models


def _engine(path: str, dims, coef: float) -> FSDPEngine:
    lm = load_causal_lm(path, dtype=torch.float32)
    return FSDPEngine(TokenLogprobModel(lm), dims, torch.device("cpu"), optim=OptimSettings(lr=1e-3, grad_clip=0.0),
                      router_aux_coef=coef)


def _zero_loss(out, micro):
    return out["logprobs"].sum() * 0.0, {}


def _aux_only(rank: int, world: int, paths: dict[str, str], batches: dict[str, object]):
    """Per family and batch: (engine's aux metric, its gradients under a zero policy loss)."""
    dims = layout_dims()
    out = {}
    for family, path in paths.items():
        engine = _engine(path, dims, COEF)
        for name, batch in batches.items():
            engine.optimizer.zero_grad(set_to_none=True)
            metrics = engine.backward_batch(batch, P, len(batch), _zero_loss, None, temperature=1.0)
            out[family, name] = metrics[METRIC], {k: v.clone() for k, v in engine.iter_full_grads()}
    return out


def _transformers_aux(path: str, batch) -> tuple[float, dict[str, torch.Tensor]]:
    """transformers' aux_loss of the rows (their positions counted from each row's first real token) and its
    gradients, HF-named."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    mask = batch["attention_mask"]
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    aux = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=position_ids,
                output_router_logits=True).aux_loss
    aux.backward()
    return float(aux.detach()), {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in model.named_parameters()}


@pytest.fixture(scope="module")
def aux_cases(tmp_path_factory):
    paths = {f: write_tiny_moe(f, str(tmp_path_factory.mktemp(f))) for f in (*FAMILIES, "gpt_oss")
             if f != "gpt_oss"}
    from tiny_gpt_oss import write_tiny_gpt_oss  # noqa: PLC0415
    from tiny_linear import write_tiny_linear  # noqa: PLC0415

    paths["gpt_oss"] = write_tiny_gpt_oss(str(tmp_path_factory.mktemp("gpt_oss")))
    for family in LINEAR_MOE:
        paths[family] = write_tiny_linear(family, str(tmp_path_factory.mktemp(family)))
    rollout = _rollout_batch(VOCAB)
    ids = torch.randint(3, VOCAB, (1, P + R), generator=torch.Generator().manual_seed(1))
    one_row = Batch.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                               "response_mask": torch.ones(1, R)})  # one row, no padding
    batches = {"one_row": one_row, "padded_rows": rollout}
    return paths, batches, run_distributed(_aux_only, 1, paths, batches)[0]


@pytest.mark.parametrize("family", (*FAMILIES, "gpt_oss", *LINEAR_MOE))
@pytest.mark.parametrize("name", ["one_row", "padded_rows"])
def test_router_aux_loss_equals_transformers(aux_cases, family, name):
    paths, batches, got = aux_cases
    metric, grads = got[family, name]
    ref, ref_grads = _transformers_aux(paths[family], batches[name])
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(paths[family])
    rtol = model_rtol(config, TOKENS)
    assert abs(metric - ref) <= scalar_tol(abs(ref), rtol), (family, name, metric, ref)
    assert_grads_close(grads, {k: COEF * g for k, g in ref_grads.items()}, rtol)


def _train_with_aux(rank: int, world: int, path: str, sp: int, micro: int, batch, ring: int = 1, ep: int = 1,
                    checkpointing: bool = False):
    """One update of the actor loss plus the auxiliary loss at (Ulysses, ring, EP): (metrics, grads, params)."""
    dims = build_parallel_dims(RoleLayout(World(1, world), ulysses=sp, ring=ring, ep=ep), "cpu")
    lm = load_causal_lm(path, dtype=torch.float32)
    if checkpointing:  # as the actor role enables it: recomputed routers in backward must add nothing
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine = FSDPEngine(TokenLogprobModel(lm), dims, torch.device("cpu"), optim=OptimSettings(lr=LR, grad_clip=0.0),
                        router_aux_coef=COEF)
    shard = batch.chunk(dims.dp_size)[dims.dp_rank]
    loss_fn = make_actor_loss(LOSS, *global_counts(shard, dims.dp_group))
    engine.optimizer.zero_grad(set_to_none=True)
    metrics = engine.backward_batch(shard, P, micro, loss_fn, None, temperature=1.0, with_entropy=True)
    grads = {k: v.clone() for k, v in engine.iter_full_grads()}
    engine.optimizer.step()
    params = {k: v.clone() for k, v in engine.iter_full_params()}  # collective
    return (metrics, grads, params) if rank == 0 else None


@pytest.fixture(scope="module")
def qwen3_aux(tmp_path_factory):
    path = write_exact_moe("qwen3_moe", str(tmp_path_factory.mktemp("qwen3_moe")))
    batch = margin_checked_batch(path, "qwen3_moe")
    reference = run_distributed(_train_with_aux, 1, path, 1, 3, batch)[0]
    assert reference[0][METRIC] > 0
    return path, batch, reference


@pytest.mark.parametrize("world,sp,ring,checkpointing", [(2, 2, 1, False), (4, 2, 2, False), (2, 2, 1, True)])
def test_ulysses_keeps_router_aux_loss_exact(qwen3_aux, world, sp, ring, checkpointing):
    """Ulysses 2, Ulysses 2 x ring 2 and Ulysses 2 with gradient checkpointing: the one-rank step (micro-batches of
    3 rows, dp 1: the same micro-batches, so the same token-weighted mean of their auxiliary losses)."""
    path, batch, reference = qwen3_aux
    got = run_distributed(_train_with_aux, world, path, sp, 3, batch, ring, 1, checkpointing)[0]
    _assert_same_step(got, reference, path, keys=(*METRICS, METRIC))


def test_expert_parallel_keeps_router_aux_loss_exact(qwen3_aux):
    """EP 2 (dp 2, each rank routes its own rows; the routers are not split): the one-rank step with the same
    micro-batches (4 rows: one per rank)."""
    path, batch, _ = qwen3_aux
    reference = run_distributed(_train_with_aux, 1, path, 1, 4, batch)[0]
    got = run_distributed(_train_with_aux, 2, path, 1, 4, batch, 1, 2)[0]
    _assert_same_step(got, reference, path, keys=(*METRICS, METRIC))


def test_actor_role_reads_override_config(qwen3_aux):
    """verl's model.override_config entries turn the loss on in the actor role (config.json leaves it off): its
    update at Ulysses 2 with the batch in one micro-batch reports transformers' aux_loss of the batch."""
    path, batch, _ = qwen3_aux
    overrides = {"actor_rollout_ref.model.override_config.output_router_logits": True,
                 "actor_rollout_ref.model.override_config.router_aux_loss_coef": COEF,
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": len(batch)}
    metrics = run_distributed(_role_update, 2, path, 2, overrides, batch)[0]
    ref = _transformers_aux(path, batch)[0]
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    assert aux_loss_coef(config) == 0.0  # config.json alone leaves it off
    assert abs(metrics[METRIC] - ref) <= scalar_tol(ref, model_rtol(config, TOKENS))


def test_router_aux_settings_and_refusals():
    from transformers import Glm4MoeConfig, Qwen3MoeConfig

    assert aux_loss_coef(Qwen3MoeConfig(router_aux_loss_coef=0.01)) == 0.0  # output_router_logits off
    on = Qwen3MoeConfig(output_router_logits=True, router_aux_loss_coef=0.01)
    assert aux_loss_coef(on) == 0.01 and router_aux_errors(on) == []
    assert router_aux_errors(on, RoleLayout(World(1, 2), tp=2)) == []  # exact: tests/distributed/test_tp_moe_exact.py
    assert "adaptive Ulysses" in router_aux_errors(on, RoleLayout(World(1, 4), ulysses=4, adaptive=True))[0]
    glm = router_aux_errors(Glm4MoeConfig(output_router_logits=True, router_aux_loss_coef=0.01))
    assert len(glm) == 1 and "glm4_moe" in glm[0] and "qwen3_moe" in glm[0]
