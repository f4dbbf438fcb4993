"""Routing replay R3's rollout side: the hf engine's MoE routes (rlsp.rollout.route_capture) and their row column.

On the tiny qwen3_moe of tests/tiny_moe.py `write_exact_moe` (fp32): every sample's routes -- its real prompt tokens
(ragged, left-padded prompts) and every generated token up to its stop (rows that stopped early are decoded on; those
tokens are not the sample's) -- equal token for token what RouterReplay records on one full forward of the final
sequence with the same weights, i.e. the routes the trainer would compute. The batch's router margin is checked to
exceed the forwards' roundoff first, so a failure says whether a tie or the capture is wrong. The rows put each
sample's routes under its tokens (zeros elsewhere). The config side: R3 refused with vLLM, tensor-parallel rollouts,
agent loops and partial rollouts, and verl's rollout.enable_rollout_routing_replay read as R3 (another mode with it
refused), also through `python -m rlsp.check`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_moe import router_margin, write_exact_moe
from tolerances import model_rtol

from rlsp.engine.moe_load import find_routers
from rlsp.engine.router_replay import ROUTE_DTYPE, ROUTES_KEY, RouterReplay, replay_config_errors, replay_mode
from rlsp.rollout.base import SamplingConfig
from rlsp.rollout.hf_engine import HFEngine
from rlsp.rollout.route_capture import ROUTE_DTYPE as CAPTURE_DTYPE
from rlsp.workers.rollout_rows import build_rollout_rows

PROMPTS = [[5, 9, 12, 7, 30], [20], [33, 4, 8]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    """An R3 engine and its samples, where one token of the first sample is made a stop token: some rows stop early."""
    path = write_exact_moe("qwen3_moe", str(tmp_path_factory.mktemp("r3") / "qwen3_moe"))
    engine = HFEngine(path, seed=0, route_finder=find_routers)
    sampling = SamplingConfig(n=2, max_tokens=MAX_TOKENS, seed=5)
    engine.stop_ids = {engine.generate(PROMPTS, sampling).response_ids[0][3]}
    return engine, engine.generate(PROMPTS, sampling)


def test_rollout_routes_equal_a_full_forward(routed):
    engine, out = routed
    assert "stop" in out.finish_reason and "length" in out.finish_reason  # early stops and full-length rows
    sequences = [PROMPTS[p] + ids for p, ids in zip(out.prompt_index, out.response_ids)]
    width = max(map(len, sequences))
    ids_NT = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    mask_NT = (torch.arange(width)[None] < torch.tensor([len(s) for s in sequences])[:, None]).long()
    gap, scale = router_margin(engine.model, ids_NT, mask_NT)
    roundoff = model_rtol(engine.model.config, width, backward=False) * scale
    assert gap > 10 * roundoff, f"a token sits {gap:.3g} from a top-k tie (roundoff {roundoff:.3g})"
    replay = RouterReplay(engine.model, "qwen3_moe")
    try:
        for row, sequence in enumerate(sequences):
            with replay.recording(), torch.no_grad():
                engine.model(input_ids=torch.tensor([sequence]))
            full_TLK = replay.recorded_local()
            assert out.routes[row].dtype == ROUTE_DTYPE and full_TLK.shape == out.routes[row].shape, row
            assert torch.equal(out.routes[row], full_TLK), f"sample {row}: the rollout's routes differ from the trainer's"
    finally:
        replay.remove()
    assert CAPTURE_DTYPE == ROUTE_DTYPE


def test_rows_carry_each_sample_routes_under_its_tokens(routed):
    _, out = routed
    prompts = [PROMPTS[p] for p in out.prompt_index]
    P = max(map(len, PROMPTS))
    rows = build_rollout_rows(prompts, out.response_ids, out.response_logprobs, P, MAX_TOKENS, 0, routes=out.routes)
    routes_BTLK = rows[ROUTES_KEY]
    assert routes_BTLK.shape == (len(out), P + MAX_TOKENS, 2, 2) and routes_BTLK.dtype == ROUTE_DTYPE
    real = rows["attention_mask"].bool()
    assert (routes_BTLK[~real] == 0).all()
    for row in range(len(out)):
        assert torch.equal(routes_BTLK[row][real[row]], out.routes[row])
    with pytest.raises(ValueError, match="sample 0: routes of shape"):
        build_rollout_rows(prompts, out.response_ids, out.response_logprobs, P, MAX_TOKENS, 0,
                           routes=[r[1:] for r in out.routes])


def _arr(mode: str = "disabled", switch: bool = False, engine: str = "hf", rollout_tp: int = 1):
    return SimpleNamespace(actor=SimpleNamespace(router_replay=SimpleNamespace(mode=mode), tensor_model_parallel_size=1),
                           rollout=SimpleNamespace(name=engine, tensor_model_parallel_size=rollout_tp,
                                                   enable_rollout_routing_replay=switch))


def test_r3_config_refusals_and_verl_switch():
    moe = SimpleNamespace(model_type="qwen3_moe", num_experts=4)
    assert replay_mode(_arr(switch=True)) == "R3" and replay_mode(_arr("R3", switch=True)) == "R3"
    assert replay_mode(_arr("R2")) == "R2" and replay_mode(_arr()) == "disabled"
    assert replay_config_errors(_arr("R3"), moe) == [] and replay_config_errors(_arr(switch=True), moe) == []
    conflict = replay_config_errors(_arr("R2", switch=True), moe)[0]
    assert "enable_rollout_routing_replay=true" in conflict and "mode='R2'" in conflict and "legal:" in conflict
    vllm = replay_config_errors(_arr(switch=True, engine="vllm"), moe)[0]
    assert "rollout.name='vllm'" in vllm and "legal: rollout.name=hf" in vllm
    assert "tensor_model_parallel_size=2" in replay_config_errors(_arr("R3", rollout_tp=2), moe)[0]
    assert "agent loops" in replay_config_errors(_arr("R3"), moe, agent_loops=True)[0]
    assert "partial_rollout=true" in replay_config_errors(_arr("R3"), moe, partial_rollout=True)[0]
    dense = replay_config_errors(_arr("R3"), SimpleNamespace(model_type="qwen2"))[0]
    assert "mode=R3 needs a mixture-of-experts model" in dense


def test_verl_switch_through_rlsp_check(routed, tmp_path):
    """verl's command spelling composes and is checked as R3: accepted with the hf engine, refused with vLLM."""
    from rlsp.check import run_checks

    engine, _ = routed
    line = [f"actor_rollout_ref.model.path={engine.model.name_or_path}", f"trainer.default_local_dir={tmp_path}",
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=True"]
    assert run_checks([*line, "actor_rollout_ref.rollout.name=hf"]).problems == []
    problems = run_checks([*line, "actor_rollout_ref.rollout.name=vllm"]).problems
    assert any(p.startswith("actor_rollout_ref.actor.router_replay.mode=R3 with actor_rollout_ref.rollout.name='vllm'")
               for p in problems), problems


def test_r3_refused_with_a_dense_model_in_the_engine(tmp_path):
    from rlsp.models.tiny import TinyModelSpec, build_tiny_model

    path = build_tiny_model(TinyModelSpec(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                          num_key_value_heads=1), str(tmp_path))
    with pytest.raises(ValueError, match="model_type='qwen2' has no router"):
        HFEngine(path, route_finder=find_routers)
