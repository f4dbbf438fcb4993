"""Expert parallelism trains the MoE families exactly: EP 2 on 2 ranks and EP 2 x Ulysses 2 on 4 ranks equal one rank.

Tiny models (tests/tiny_moe.py `write_exact_moe`: 2 layers, 4 experts, 2 per token) go through the FSDP2 policy
engine as tests/distributed/test_moe_exact.py's do, with `RoleLayout.ep = 2`: each rank keeps 2 of every layer's 4
experts, its tokens (its rows, or its sequence shard under Ulysses) reach the other experts by all-to-all
(rlsp.parallel.expert_parallel), and FSDP2 shards the experts over the ranks that hold the same ones. The loss
metrics, every parameter's full gradient (expert gradients gathered over the expert-parallel group into the HF
tensor) and the AdamW step equal one process's within tests/tolerances.py's bounds; the expert load counted by
the routers equals one process's count by count. qwen3_moe at every layout; at EP 2 also qwen2_moe and glm4_moe
(shared experts beside the routed ones; glm4_moe's sigmoid routing and dense first layer), mixtral, olmoe, gpt_oss
(expert biases, transposed weights) and deepseek_v3 (8 experts, grouped top-k, dense first layer): one registered
experts implementation covers them all.

The fixture asserts every token's top-k margin exceeds the roundoff bound (as test_moe_exact does), so a failure
here is a dispatch, combine or gradient-reduction bug, not a routing flip.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _launch import run_distributed
from test_fsdp_engine import LOSS, P, policy_engine
from test_moe_exact import _assert_same_step_and_load, margin_checked_batch, step_and_count
from tiny_deepseek import write_tiny_deepseek
from tiny_gpt_oss import write_tiny_gpt_oss
from tiny_moe import MOE_FAMILIES, moe_config, write_exact_moe
from tolerances import assert_grads_close, assert_tensor_close, roundoff_rtol

from rlsp.config.layout import RoleLayout, World
from rlsp.parallel.mesh import build_parallel_dims
from rlsp.workers.actor_loss import make_actor_loss
from rlsp.workers.ppo_loop import global_counts

pytestmark = pytest.mark.distributed


def _train_ep(rank: int, world: int, path: str, ulysses: int, ep: int, micro: int, batch, ring: int = 1,
              fsdp_size: int = -1):
    """One update at (ulysses, ring, ep, fsdp_size) on `world` ranks: (metrics, grads, params, tokens per expert
    [L, E])."""
    layout = RoleLayout(World(1, world), ulysses=ulysses, ring=ring, ep=ep, fsdp_size=fsdp_size)
    dims = build_parallel_dims(layout, "cpu")
    engine = policy_engine(path, dims)
    if ep > 1:  # the experts really are split: this rank holds E/ep of each layer's
        local = {name: (shard.local, shard.num_experts) for name, shard in engine.ep_names.items()}
        assert local and all(n == total // ep for n, total in local.values()), local
    out = step_and_count(engine, dims, batch, micro)
    return out if rank == 0 else None


def _write(family: str, out_dir: str) -> str:
    if family == "gpt_oss":
        return write_tiny_gpt_oss(out_dir)
    return write_tiny_deepseek("v3", out_dir) if family == "deepseek_v3" else write_exact_moe(family, out_dir)


@pytest.fixture(scope="module", params=[*MOE_FAMILIES, "gpt_oss", "deepseek_v3"])
def ep_model_and_batch(request, tmp_path_factory):
    path = _write(request.param, str(tmp_path_factory.mktemp(request.param)))
    batch = margin_checked_batch(path, request.param)
    reference = run_distributed(_train_ep, 1, path, 1, 1, len(batch), batch)[0]
    return path, batch, reference


def test_ep2_keeps_moe_loss_gradients_step_and_load_exact(ep_model_and_batch):
    path, batch, reference = ep_model_and_batch
    got = run_distributed(_train_ep, 2, path, 1, 2, 3, batch)[0]
    assert any(".experts." in name for name in reference[1]), sorted(reference[1])
    assert {k: v.shape for k, v in got[1].items()} == {k: v.shape for k, v in reference[1].items()}  # whole tensors
    _assert_same_step_and_load(got, reference, path, batch)


@pytest.mark.parametrize("ep_model_and_batch", ["qwen3_moe"], indirect=True)
@pytest.mark.parametrize("world,ulysses,ring,fsdp_size", [(4, 2, 1, -1), (2, 1, 2, -1), (2, 1, 1, 1)])
def test_ep2_with_sequence_parallel_or_hsdp_keeps_qwen3_moe_exact(ep_model_and_batch, world, ulysses, ring,
                                                                   fsdp_size):
    """EP 2 x Ulysses 2 on 4 ranks (dp 2; experts split over each Ulysses pair -- the sequence shard is the
    dispatch unit -- and sharded by FSDP2 over the two ranks holding the same experts), EP 2 x ring 2, and EP 2 with
    fsdp_size=1 (the other weights replicated, HSDP): the same step as one rank."""
    path, batch, reference = ep_model_and_batch
    got = run_distributed(_train_ep, world, path, ulysses, 2, 2, batch, ring, fsdp_size)[0]
    _assert_same_step_and_load(got, reference, path, batch)



def _save_restore_continue(rank: int, world: int, path: str, ckpt: str, batch):
    """Train one step at EP 2, save; a fresh EP 2 engine loads it; both take the same next step; an EP 1 engine
    loads it too. Rank 0's full params: (saved, restored, continued step, restored engine's step, EP 1 load)."""
    from rlsp.engine.checkpoint import load_engine, save_engine

    dims = build_parallel_dims(RoleLayout(World(1, world), ep=2), "cpu")
    shard = batch.chunk(dims.dp_size)[dims.dp_rank]
    loss_fn = make_actor_loss(LOSS, *global_counts(shard, dims.dp_group))

    def step(engine):
        engine.optimizer.zero_grad(set_to_none=True)
        engine.backward_batch(shard, P, 4, loss_fn, None, temperature=1.0, with_entropy=True)
        engine.optimizer.step()
        return {k: v.clone() for k, v in engine.iter_full_params()}

    first = policy_engine(path, dims)
    saved = step(first)
    save_engine(first, ckpt)
    continued = step(first)
    restored = policy_engine(path, dims)
    load_engine(restored, ckpt)
    loaded = {k: v.clone() for k, v in restored.iter_full_params()}
    resumed = step(restored)
    plain = policy_engine(path, build_parallel_dims(RoleLayout(World(1, world)), "cpu"))  # ep 1: resharded on load
    load_engine(plain, ckpt)
    unsplit = {k: v.clone() for k, v in plain.iter_full_params()}
    return (saved, loaded, continued, resumed, unsplit) if rank == 0 else None


@pytest.mark.parametrize("ep_model_and_batch", ["qwen3_moe"], indirect=True)
def test_ep2_checkpoint_holds_whole_experts_and_resumes_exactly(ep_model_and_batch, tmp_path):
    """A checkpoint written at EP 2 holds every expert tensor whole under its HF name (read offline into one
    process, as export does; and into an engine without expert parallelism, resharded); an EP 2 engine restored
    from it holds the same weights and optimizer state: its next step equals the uninterrupted engine's bit for
    bit."""
    from transformers import AutoModelForCausalLM

    from rlsp.engine.checkpoint import load_model_offline
    from rlsp.models.lm import TokenLogprobModel

    path, batch, _ = ep_model_and_batch
    saved, loaded, continued, resumed, unsplit = run_distributed(_save_restore_continue, 2, path, str(tmp_path / "ckpt"),
                                                        batch)[0]
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name
        assert torch.equal(resumed[name], continued[name]), name
        assert torch.equal(unsplit[name], value), name
    offline = TokenLogprobModel(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    load_model_offline(offline, str(tmp_path / "ckpt"))
    for name, value in offline.lm.named_parameters():
        assert torch.equal(value.detach(), saved[name]), name


def _dispatch_all_to_rank0(rank: int, world: int):
    """One qwen3_moe experts module (fp64) applied to 5 tokens per rank, every token routed to experts 0 and 1 (rank
    0's at EP 2): rank 1 receives no pair at all. Returns this rank's (output, token gradient, expert gradients
    summed over ranks) of the expert-parallel module and of the whole module."""
    import copy

    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from rlsp.parallel.expert_parallel import apply_expert_parallel

    torch.manual_seed(0)
    whole = Qwen3MoeExperts(moe_config("qwen3_moe")).double()
    for p in whole.parameters():
        torch.nn.init.normal_(p, std=0.2)
    split = copy.deepcopy(whole)
    apply_expert_parallel(split, dist.group.WORLD)
    hidden_NH = torch.randn(world, 5, 64, dtype=torch.float64)[rank]
    index_NK = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]])
    weights_NK = torch.rand(5, 2, dtype=torch.float64).softmax(-1)
    grad_NH = torch.randn(world, 5, 64, dtype=torch.float64)[rank]
    results = []
    for module in (split, whole):
        x_NH = hidden_NH.clone().requires_grad_(True)
        out_NH = module(x_NH, index_NK, weights_NK)
        out_NH.backward(grad_NH)
        grads = {}
        for name, p in module.named_parameters():
            g = p.grad.clone()
            if module is split:  # this rank's slice of the whole gradient
                g = torch.cat([torch.zeros_like(g)] * rank + [g] + [torch.zeros_like(g)] * (world - 1 - rank))
            dist.all_reduce(g)
            grads[name] = g
        results.append((out_NH.detach(), x_NH.grad, grads))
    return results


def test_dispatch_with_a_rank_that_receives_nothing_is_exact():
    """All tokens of both ranks go to rank 0's experts: rank 1 computes nothing yet joins both all-to-alls forward
    and backward (no hang), its experts get a zero gradient, and every output, token gradient and expert gradient
    equals the whole module's (fp64: the bound of a few reordered sums over 64 terms)."""
    rtol = roundoff_rtol(reduction=64, stages=4, dtype=torch.float64)
    for (out, x_grad, grads), (ref_out, ref_x_grad, ref_grads) in run_distributed(_dispatch_all_to_rank0, 2):
        assert_tensor_close(out, ref_out, rtol, float(ref_out.abs().max()))
        assert_tensor_close(x_grad, ref_x_grad, rtol, float(ref_x_grad.abs().max()))
        assert_grads_close(grads, ref_grads, rtol)
        assert all(float(g[2:].abs().max()) == 0.0 for g in ref_grads.values())  # experts 2, 3 unused
