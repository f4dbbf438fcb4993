"""MoE routing replay R3 through the roles: RolloutRole's hf engine records the routes, ActorRole replays them.

One process, the tiny qwen3_moe of tests/tiny_moe.py `write_exact_moe` in fp32, configured with verl's switch
(`actor_rollout_ref.rollout.enable_rollout_routing_replay=true`, read as router_replay.mode=R3):
* generation writes the rows' routes column; the old-logprob pass replays it (and writes none of its own): its
  logprobs equal the engine's sampling logprobs within tests/tolerances.py's `logprob_tol`, and the routers' final
  outputs (hooks after the replay's) hold exactly the rollout's experts, in the old-logprob pass and in the update;
* after the trainer's router weights move (the rollout's stay: a stale or differently computed rollout), free routing
  picks other experts for some tokens and the rollout-vs-trainer logprob gap grows; replaying the rollout's routes
  keeps it smaller (the test prints both gaps).
"""

from __future__ import annotations

import pytest
import torch
from _launch import run_distributed
from omegaconf import OmegaConf
from test_fsdp_engine import LOSS
from tiny_moe import write_exact_moe
from tolerances import logprob_tol

from rlsp.config.layout import ParallelLayout, RoleLayout, World
from rlsp.config.schema import RLSPConfig
from rlsp.data.batch import Batch
from rlsp.data.packing import pack_values
from rlsp.engine.router_replay import ROUTES_KEY
from rlsp.workers.actor_loss import make_actor_loss
from rlsp.workers.context import RoleContext
from rlsp.workers.ppo_loop import global_counts
from rlsp.workers.roles.actor import ActorRole
from rlsp.workers.roles.rollout import RolloutRole

pytestmark = pytest.mark.distributed

P, R, MICRO = 6, 8, 64  # prompt width, response width, rows per micro-batch (all rows in one)
PROMPTS = [[5, 9, 12, 7, 30, 2], [20], [33, 4, 8], [11, 40, 41, 42]]
SAMPLING = {"n": 2, "temperature": 1.0, "max_tokens": R, "seed": 5}
ROUTER_NOISE = 0.002  # trainer-side router perturbation (weights ~ N(0, 0.05)): flips some top-k choices


def _config(path: str):
    cfg = OmegaConf.structured(RLSPConfig)
    arr = "actor_rollout_ref"
    for key, val in {"trainer.n_gpus_per_node": 1, f"{arr}.model.path": path, f"{arr}.model.dtype": "float32",
                     f"{arr}.rollout.name": "hf", f"{arr}.rollout.dtype": "float32", f"{arr}.rollout.n": SAMPLING["n"],
                     f"{arr}.rollout.enable_rollout_routing_replay": True, f"{arr}.actor.use_torch_compile": False,
                     "data.max_prompt_length": P, "data.max_response_length": R}.items():
        OmegaConf.update(cfg, key, val)
    return cfg


class _Seen:
    """What each router finally returns (hooks registered after the replay's prepended ones): its top-k indices."""

    def __init__(self, routers) -> None:
        self.idx: list[list[torch.Tensor]] = [[] for _ in routers]
        for layer, router in enumerate(routers):
            router.register_forward_hook(lambda m, a, out, layer=layer: self.idx[layer].append(out[-1].detach().clone()))

    def last(self) -> torch.Tensor:
        """[S, L, K] of the last forward."""
        return torch.stack([idx[-1] for idx in self.idx], dim=1)


def _stream(engine, rows: Batch, micro_size: int) -> tuple[torch.Tensor, int]:
    """The rows' routes in the order the routers see the micro-batch's stream, and its count of real tokens."""
    ((plan, part),) = engine._micro_batches(rows, micro_size, None)
    packed = engine.prepare(part, P, plan.degree).packed
    return pack_values(part[ROUTES_KEY].long(), packed)[: packed.num_real], packed.num_real


def _gap(old_BR: torch.Tensor, rows: Batch) -> torch.Tensor:
    mask = rows["response_mask"].bool()
    return (old_BR - rows["rollout_logprobs"])[mask].abs()


def _r3_roles(rank: int, world: int, path: str) -> dict:
    cfg = _config(path)
    role = RoleLayout(World(1, 1))
    ctx = RoleContext(cfg, rank, ParallelLayout(World(1, 1), role, role, None), torch.device("cpu"), pad_token_id=0)
    prompts = Batch.from_dict({"prompt_index": torch.arange(len(PROMPTS))}, meta={"prompt_ids": PROMPTS})
    rows = RolloutRole(ctx).generate(prompts, SAMPLING)
    actor = ActorRole(ctx)
    seen = _Seen(actor.engine.router_replay.routers)
    old = actor.compute_log_prob(rows)
    expected, real = _stream(actor.engine, rows, MICRO)
    got = {"written": sorted(old.tensors.keys()), "old_seen": torch.equal(seen.last()[:real], expected),
           "same_gap": _gap(old["old_logprobs"], rows)}
    batch = rows.select_rows(list(range(len(rows))))
    mask = rows["response_mask"]
    for key, val in {"old_logprobs": old["old_logprobs"], "ref_logprobs": old["old_logprobs"],
                     "advantages": torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask}.items():
        batch.set(key, val)
    actor.engine.backward_batch(batch, P, MICRO, make_actor_loss(LOSS, *global_counts(batch, actor.engine.dims.dp_group)),
                                temperature=1.0, with_entropy=True)
    got["update_seen"] = torch.equal(seen.last()[:real], _stream(actor.engine, batch, MICRO)[0])
    with torch.no_grad():
        for router in actor.engine.router_replay.routers:
            router.weight.add_(ROUTER_NOISE * torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(2)))
    free = actor.engine.infer_many(rows, P, MICRO, ("logprobs",), record_routes=True, temperature=1.0)
    real_rows = rows["attention_mask"].bool()
    got["flipped"] = int((free[ROUTES_KEY][real_rows] != rows[ROUTES_KEY][real_rows]).any(-1).any(-1).sum())
    got["moved_free_gap"] = _gap(free["logprobs"], rows)
    got["moved_r3_gap"] = _gap(actor.compute_log_prob(rows)["old_logprobs"], rows)
    got["tokens"] = int(real_rows.sum())
    return got


def test_r3_roles_replay_the_rollout_routes(tmp_path):
    path = write_exact_moe("qwen3_moe", str(tmp_path / "qwen3_moe"))
    got = run_distributed(_r3_roles, 1, path)[0]
    from transformers import AutoConfig

    assert ROUTES_KEY not in got["written"]  # R3: the old-logprob pass replays the rollout's routes, records none
    assert got["old_seen"] and got["update_seen"]
    tol = logprob_tol(AutoConfig.from_pretrained(path), P + R)
    assert float(got["same_gap"].max()) <= tol, (float(got["same_gap"].max()), tol)
    free, r3 = got["moved_free_gap"], got["moved_r3_gap"]
    print(f"\nR3 gap after router noise {ROUTER_NOISE}: {got['flipped']}/{got['tokens']} tokens routed otherwise by "
          f"the trainer; rollout-vs-trainer |logprob| gap free max {float(free.max()):.4g} mean {float(free.mean()):.4g}"
          f", replayed max {float(r3.max()):.4g} mean {float(r3.mean()):.4g}; same weights max "
          f"{float(got['same_gap'].max()):.3g} (bound {tol:.3g})")
    assert got["flipped"] > 0  # the moved routers choose other experts somewhere
    assert float(r3.max()) < float(free.max()) and float(r3.mean()) < float(free.mean())
