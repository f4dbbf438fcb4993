"""MoE routing replay R2 (rlsp.engine.router_replay). Every replayable family (qwen2_moe, qwen3_moe, olmoe, mixtral,
glm4_moe, deepseek_v3, gpt_oss; tiny models from transformers' config classes): replaying the routes recorded from the
same weights gives the logits and gradients bit for bit, and other routes change them (the hook takes effect). On the
tiny qwen3_moe of tests/tiny_moe.py `write_exact_moe`: after the router weights move, the replayed forward keeps the
recorded experts token for token while a free forward picks others, and its weights are qwen3_moe's formula; the
replay also holds in gradient checkpointing's recomputation; padded rows round-trip through the packed stream. The
config refusals (R3 with vLLM, dense, unreplayable family, tensor parallelism) name the value."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlsp.data.batch import Batch
from rlsp.engine.micro import prepare_micro_batch
from rlsp.engine.router_replay import (
    REPLAYABLE_TYPES,
    RolloutFacts,
    RouterReplay,
    check_replayable,
    router_replay_errors,
)
from tests.tiny_deepseek import deepseek_config
from tests.tiny_gemma import gemma_config
from tests.tiny_gpt_oss import gpt_oss_config
from tests.tiny_moe import EXACT_SHAPE, MOE_FAMILIES, moe_config, write_exact_moe

N_TOKENS = 24


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return write_exact_moe("qwen3_moe", str(tmp_path_factory.mktemp("r2") / "qwen3_moe"))


def _load(path: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _input_ids(model) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (1, N_TOKENS), generator=torch.Generator().manual_seed(1))


def _forward_with_grads(model, input_ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=input_ids).logits
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _router_outputs(replay: RouterReplay) -> list[list]:
    """Hooks after the replay's: the (logits, weights, indices) each router finally returns."""
    seen: list[list] = [[] for _ in replay.routers]
    for layer, router in enumerate(replay.routers):
        router.register_forward_hook(lambda m, a, out, layer=layer: seen[layer].append(out))
    return seen


def _family_model(family: str):
    torch.manual_seed(0)
    if family in MOE_FAMILIES:
        config = moe_config(family, **EXACT_SHAPE)
    else:
        config = gpt_oss_config() if family == "gpt_oss" else deepseek_config("v3")
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.mark.parametrize("family", sorted(REPLAYABLE_TYPES))
def test_same_weights_replay_is_exact(family):
    """Every replayable family: replaying its own routes gives its logits and gradients bit for bit."""
    model = _family_model(family)
    replay = RouterReplay(model, family)
    assert {type(r).__name__ for r in replay.routers} == {REPLAYABLE_TYPES[family]}
    input_ids = _input_ids(model)
    with replay.recording():
        ref_logits, ref_grads = _forward_with_grads(model, input_ids)
    routes_SLK = replay.recorded_local()
    assert routes_SLK.shape == (N_TOKENS, len(replay.routers), replay.top_k) and routes_SLK.dtype == torch.int16
    with replay.replaying_local(routes_SLK):
        logits, grads = _forward_with_grads(model, input_ids)
    assert torch.equal(logits, ref_logits)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), name
    assert all(ref_grads[r].abs().sum() > 0 for r in ref_grads if r.endswith("gate.weight"))  # weights get gradients
    experts = replay.routers[0].weight.shape[0]  # every router here: weight [E, hidden]
    with replay.replaying_local((routes_SLK + 1) % experts), torch.no_grad():  # other experts: the hook takes effect
        assert not torch.allclose(model(input_ids=input_ids).logits, ref_logits)


def test_replay_keeps_recorded_experts_after_router_moves(moe_dir):
    model = _load(moe_dir)
    replay = RouterReplay(model, "qwen3_moe")
    input_ids = _input_ids(model)
    with replay.recording(), torch.no_grad():
        model(input_ids=input_ids)
    routes_SLK = replay.recorded_local()
    with torch.no_grad():
        for router in replay.routers:
            router.weight.add_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(2)))
    seen = _router_outputs(replay)
    with replay.recording(), torch.no_grad():
        model(input_ids=input_ids)
    free_SLK = replay.recorded_local()
    assert not torch.equal(free_SLK, routes_SLK)  # the moved routers choose other experts somewhere
    with replay.replaying_local(routes_SLK), torch.no_grad():
        model(input_ids=input_ids)
    for layer in range(len(replay.routers)):
        logits_NE, weights_NK, idx_NK = seen[layer][-1]
        assert torch.equal(idx_NK, routes_SLK[:, layer].long())
        # qwen3_moe's rule (norm_topk_prob=True), in the fp32 operations its router uses: equal bit for bit
        probs_NE = torch.nn.functional.softmax(logits_NE, dtype=torch.float, dim=-1)
        expected_NK = probs_NE[torch.arange(len(idx_NK))[:, None], idx_NK]
        assert torch.equal(weights_NK, expected_NK / expected_NK.sum(-1, keepdim=True))


def test_recorded_rows_round_trip(moe_dir):
    """Rows -> stream -> rows: the recorded columns of padded rows put each real token's routes back in place."""
    model = _load(moe_dir)
    replay = RouterReplay(model, "qwen3_moe")
    ids = torch.randint(1, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0  # a left-padded prompt
    micro = prepare_micro_batch(Batch.from_dict({"input_ids": ids, "attention_mask": mask}), 4, None, 2, 2)
    with replay.recording(), torch.no_grad():
        model(input_ids=micro.packed.input_ids[None], position_ids=micro.packed.position_ids[None])
    rows_BLLK = replay.recorded_rows(micro)
    assert rows_BLLK.shape == (2, 8, 2, 2) and rows_BLLK.dtype == torch.int16
    assert (rows_BLLK[0, :3] == 0).all()
    with replay.replaying(micro, rows_BLLK):
        assert torch.equal(replay._replay_SLK, replay.recorded_local())


def test_dense_model_refused():
    model = AutoModelForCausalLM.from_config(gemma_config("gemma2"))
    with pytest.raises(ValueError, match="gemma2.*has no router"):
        check_replayable(model, "gemma2")


def test_config_refusals_name_the_value():
    from types import SimpleNamespace

    moe = SimpleNamespace(model_type="qwen3_moe", num_experts=4)
    assert router_replay_errors("disabled", SimpleNamespace(model_type="qwen2")) == []
    assert router_replay_errors("R2", moe) == []
    assert "legal: disabled, R2, R3" in router_replay_errors("R4", moe)[0]
    assert router_replay_errors("R3", moe) == []  # the hf rollout engine records the routes
    assert "rollout.name='vllm'" in router_replay_errors("R3", moe, rollout=RolloutFacts("vllm"))[0]
    assert "model_type='qwen2' is dense" in router_replay_errors("R2", SimpleNamespace(model_type="qwen2"))[0]
    assert "model_type='minimax'" in router_replay_errors("R2", SimpleNamespace(model_type="minimax",
                                                                                 num_local_experts=4))[0]
    assert router_replay_errors("R2", moe, tp=2) == []  # exact under tp: tests/distributed/test_tp_moe_exact.py


def test_replay_covers_checkpoint_recomputation(moe_dir):
    """With gradient checkpointing the routers run again in backward: they must replay there too, so the gradients
    of a replayed pass after the routers moved equal the non-checkpointed replayed pass's."""
    model = _load(moe_dir)
    replay = RouterReplay(model, "qwen3_moe")
    input_ids = _input_ids(model)
    with replay.recording(), torch.no_grad():
        model(input_ids=input_ids)
    routes_SLK = replay.recorded_local()
    with torch.no_grad():
        for router in replay.routers:
            router.weight.add_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(2)))
    model.train()  # checkpointing recomputes in training mode only; the tiny model has no dropout
    with replay.replaying_local(routes_SLK):
        _, plain = _forward_with_grads(model, input_ids)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with replay.replaying_local(routes_SLK):
        _, checkpointed = _forward_with_grads(model, input_ids)
    _, free = _forward_with_grads(model, input_ids)
    for name, grad in checkpointed.items():
        assert torch.equal(grad, plain[name]), name
    assert any(not torch.equal(g, plain[n]) for n, g in free.items())  # free routing: other gradients
