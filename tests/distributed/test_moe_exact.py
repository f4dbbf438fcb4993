"""The plain MoE families (qwen2_moe, qwen3_moe, mixtral, olmoe, glm4_moe) train exactly under Ulysses and ring.

Tiny models of the five (tests/tiny_moe.py `write_exact_moe`: 2 layers, 4 experts, 2 per token, 6 q / 2 kv heads;
qwen2_moe and glm4_moe with a shared expert, glm4_moe with a dense first layer and sigmoid routing) go through the
FSDP2 policy engine as tests/distributed/test_fsdp_engine.py's model does: at Ulysses 2 (heads 3+3 q, 1+1 kv) and
Ulysses 4 (uneven 2+2+1+1 q, kv replicated), and qwen3_moe at ring 2 and Ulysses 2 x ring 2, the loss metrics,
every parameter's full gradient (routers and experts included) and the AdamW step equal one process's within
tests/tolerances.py's bounds for the model; the expert load the engine counts (rlsp.engine.moe_load: every real
token counted once, whichever rank routes it) equals one process's count by count, and the actor role reports it
(ActorRole.update_actor at Ulysses 2: `actor/moe/load_max_over_mean`, `actor/moe/unused_expert_share`).

Conditioning: a token whose k-th and (k+1)-th router scores lie within roundoff of each other may be routed
differently by two layouts, which moves gradients by O(1e-2) (tests/tiny_linear.py). The fixture measures the
reference forward's top-k margin and asserts it exceeds the roundoff bound, so a failure says which it is.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _launch import layout_dims, run_distributed
from test_fsdp_engine import LOSS, TOKENS, P, _assert_same_step, _role_update, _rollout_batch, policy_engine
from tiny_moe import MOE_FAMILIES, router_margin, write_exact_moe
from tolerances import model_rtol

from rlsp.workers.actor_loss import make_actor_loss
from rlsp.workers.ppo_loop import global_counts

pytestmark = pytest.mark.distributed


def _train_and_count(rank: int, world: int, path: str, sp: int, micro: int, batch, ring: int = 1):
    """test_fsdp_engine's `_train_once` step, with the expert load of its forwards: (metrics, grads, params,
    tokens per expert [L, E] summed over ranks)."""
    dims = layout_dims(ulysses=sp, ring=ring)
    out = step_and_count(policy_engine(path, dims), dims, batch, micro)
    return out if rank == 0 else None


def step_and_count(engine, dims, batch, micro: int):
    """One update of `engine` on this rank's shard of `batch` (collective): (metrics, full grads, full params after
    the step, tokens per expert [L, E] summed over ranks)."""
    shard = batch.chunk(dims.dp_size)[dims.dp_rank]
    loss_fn = make_actor_loss(LOSS, *global_counts(shard, dims.dp_group))
    engine.optimizer.zero_grad(set_to_none=True)
    metrics = engine.backward_batch(shard, P, micro, loss_fn, None, temperature=1.0, with_entropy=True)
    counts_LE = engine.expert_load.counts_LE.clone()
    dist.all_reduce(counts_LE)
    metrics.update(engine.expert_load.reduce())
    grads = {k: v.clone() for k, v in engine.iter_full_grads()}
    engine.optimizer.step()
    params = {k: v.clone() for k, v in engine.iter_full_params()}
    return metrics, grads, params, counts_LE


def margin_checked_batch(path: str, family: str):
    """The rollout batch of the model at `path`, asserted to route every token well clear of a top-k tie (so two
    layouts cannot pick different experts by roundoff)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = _rollout_batch(model.config.vocab_size)
    gap, scale = router_margin(model, batch["input_ids"], batch["attention_mask"])
    roundoff = model_rtol(model.config, TOKENS, backward=False) * scale
    assert gap > 10 * roundoff, f"{family}: a token sits {gap:.3g} from a top-k tie (roundoff {roundoff:.3g})"
    return batch


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_model_and_batch(request, tmp_path_factory):
    path = write_exact_moe(request.param, str(tmp_path_factory.mktemp(request.param)))
    batch = margin_checked_batch(path, request.param)
    reference = run_distributed(_train_and_count, 1, path, 1, len(batch), batch)[0]
    return path, batch, reference


def _assert_same_step_and_load(got: tuple, ref: tuple, path: str, batch) -> None:
    _assert_same_step(got[:3], ref[:3], path)
    counts_LE, ref_counts_LE = got[3], ref[3]
    k = int(ref_counts_LE[0].sum()) // int(batch["attention_mask"].sum())
    assert k == 2 and (ref_counts_LE.sum(-1) == ref_counts_LE[0].sum()).all()  # every real token, k experts each
    assert torch.equal(counts_LE, ref_counts_LE), (counts_LE, ref_counts_LE)
    for key in ("actor/moe/load_max_over_mean", "actor/moe/unused_expert_share"):
        assert got[0][key] == ref[0][key], (key, got[0][key], ref[0][key])


@pytest.mark.parametrize("world,sp,micro", [(2, 2, 3), (4, 4, 2)])
def test_ulysses_keeps_moe_loss_gradients_step_and_load_exact(moe_model_and_batch, world, sp, micro):
    path, batch, reference = moe_model_and_batch
    got = run_distributed(_train_and_count, world, path, sp, micro, batch)[0]
    _assert_same_step_and_load(got, reference, path, batch)


@pytest.mark.parametrize("moe_model_and_batch", ["qwen3_moe"], indirect=True)  # one family: ring is per layer
@pytest.mark.parametrize("world,ulysses,ring", [(2, 1, 2), (4, 2, 2)])
def test_ring_keeps_qwen3_moe_loss_gradients_step_and_load_exact(moe_model_and_batch, world, ulysses, ring):
    path, batch, reference = moe_model_and_batch
    got = run_distributed(_train_and_count, world, path, ulysses, 3, batch, ring)[0]
    _assert_same_step_and_load(got, reference, path, batch)


@pytest.mark.parametrize("moe_model_and_batch", ["qwen3_moe"], indirect=True)
def test_actor_role_reports_expert_load(moe_model_and_batch):
    """update_actor's metrics carry the step's expert load: at Ulysses 2 with micro-batches of 3 rows (every token
    routed once) the same as one process's count over the whole batch."""
    path, batch, reference = moe_model_and_batch
    metrics = run_distributed(_role_update, 2, path, 2, {}, batch)[0]
    for key in ("actor/moe/load_max_over_mean", "actor/moe/unused_expert_share"):
        assert metrics[key] == reference[0][key], (key, metrics[key], reference[0][key])
