"""Agent loops over a real engine (HF generate, the tiny model, fp32 on CPU): token-in/token-out exactness,
the rows the rollout role builds from trajectories, the batching server under slow tools, and failures.

The environment loop below is a user loop (registered from a file, as agent_loop_config_path does): the
policy writes, the environment answers with a user turn, three times. Each turn's generation must be
what the engine gives for exactly the accumulated ids, the mask must be 1 exactly on generated tokens,
and the engine's logprobs must equal a full forward of the whole trajectory (what the trainer recomputes).
"""

from __future__ import annotations

import pytest
import torch
from tolerances import logprob_tol
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlsp.agent.loop import AgentLoopOutput, AgentSample, agent_loop_class
from rlsp.agent.runner import AgentRunner, load_agent_loop_config
from rlsp.config.compose import compose_config
from rlsp.data.batch import Batch
from rlsp.models.tiny import TinyModelSpec, ensure_tiny_model
from rlsp.rollout import SamplingConfig, build_rollout_engine
from rlsp.workers.agent_rollout import agent_generate

GREEDY = SamplingConfig(n=1, temperature=0.0, max_tokens=40)

ENV_LOOP = '''
import asyncio
from rlsp.agent.loop import AgentLoop, AgentLoopOutput

class EchoEnv(AgentLoop):
    """The policy writes up to 6 tokens; the environment closes the turn and answers 'again <k>' as a user.

    A sample whose index is in `blocked` has a slow first environment step: it returns only once every
    other trajectory has finished (or fails after 60 s), so the others must run all their turns while it
    waits."""
    blocked = set()
    _open = None  # indices of unblocked trajectories still running, and the event set when none is

    async def run(self, sample):
        chat, server, idx = self.env.chat, self.env.server, sample.extra_info.get("index")
        if EchoEnv._open is None:
            EchoEnv._open = (set(), asyncio.Event())
        if idx not in self.blocked:
            EchoEnv._open[0].add(idx)
        end = min(chat.end_of_turn_ids())
        ids, mask, lps, turns = [], [], [], 0
        while turns < 3 and sample.max_response_tokens - len(ids) > 0:
            gen = await server.generate(sample.prompt_ids + ids, min(6, sample.max_response_tokens - len(ids)))
            ids, mask, lps, turns = ids + gen.ids, mask + [1] * len(gen.ids), lps + gen.logprobs, turns + 1
            if turns == 3:
                break
            closing = [] if gen.ids and gen.ids[-1] == end else [end]
            obs = closing + chat.observation_ids([{"role": "user", "content": f"again {turns}"}])
            async with server.tool_call():
                if idx in self.blocked and turns == 1:
                    await asyncio.wait_for(EchoEnv._open[1].wait(), 60)
            ids, mask, lps = ids + obs, mask + [0] * len(obs), lps + [0.0] * len(obs)
        if idx not in self.blocked:
            EchoEnv._open[0].discard(idx)
            if not EchoEnv._open[0]:
                EchoEnv._open[1].set()
        return AgentLoopOutput(list(sample.prompt_ids), ids, mask, lps, num_turns=turns,
                               step_rewards=[(len(ids) - 1, 0.5)], extra={"env": "echo"})

class Broken(AgentLoop):
    async def run(self, sample):
        raise KeyError("no such board")
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return ensure_tiny_model(str(tmp_path_factory.mktemp("tiny")), TinyModelSpec())


@pytest.fixture(scope="module")
def engine(model_dir: str):
    return build_rollout_engine("hf", model_dir, dtype="float32", seed=0, max_model_len=128)


@pytest.fixture(scope="module")
def runner(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> AgentRunner:
    folder = tmp_path_factory.mktemp("loops")
    (folder / "env_loops.py").write_text(ENV_LOOP)
    (folder / "loops.yaml").write_text(f"- name: echo_env\n  _target_: {folder}/env_loops.py:EchoEnv\n"
                                       f"- name: broken_env\n  _target_: {folder}/env_loops.py:Broken\n")
    cfg = compose_config(overrides=["actor_rollout_ref.rollout.multi_turn.enable=true",
                                    f"actor_rollout_ref.rollout.agent.agent_loop_config_path={folder}/loops.yaml"])
    return AgentRunner(cfg.actor_rollout_ref.rollout, AutoTokenizer.from_pretrained(model_dir))


def _samples(runner: AgentRunner, n: int, budget: int = 90) -> list[AgentSample]:
    questions = [f"{a}+{a * 3}=" for a in range(1, n + 1)]
    return [AgentSample(runner.chat.prompt_ids([{"role": "user", "content": q}]), [{"role": "user", "content": q}],
                        budget, extra_info={"index": i}) for i, q in enumerate(questions)]


def test_single_turn_agent_equals_one_generate_call(runner: AgentRunner, engine) -> None:
    samples = _samples(runner, 4, budget=GREEDY.max_tokens)
    outs, stats = runner.run(engine, samples, ["single_turn_agent"] * 4, GREEDY)
    direct = engine.generate([s.prompt_ids for s in samples], GREEDY)
    assert stats.calls == 1 and stats.batch_sizes == [4]
    for i, out in enumerate(outs):
        assert out.response_ids == direct.response_ids[i]
        assert out.response_logprobs == direct.response_logprobs[i]
        assert out.response_mask == [1] * len(out.response_ids) and out.finish_reason == direct.finish_reason[i]


def test_multi_turn_ids_are_the_engines_continuations_and_logprobs_match_a_full_forward(
        runner: AgentRunner, engine, model_dir: str) -> None:
    samples = _samples(runner, 3)
    outs, _ = runner.run(engine, samples, ["echo_env"] * 3, GREEDY)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for sample, out in zip(samples, outs):
        assert out.num_turns == 3 and sum(out.response_mask) < len(out.response_ids)
        # Replay: every policy segment is the engine's greedy continuation of exactly the ids before it.
        starts = [i for i, m in enumerate(out.response_mask) if m and (i == 0 or not out.response_mask[i - 1])]
        for start in starts:
            end = next((i for i in range(start, len(out.response_mask)) if not out.response_mask[i]), len(out.response_ids))
            again = engine.generate([sample.prompt_ids + out.response_ids[:start]],
                                    SamplingConfig(n=1, temperature=0.0, max_tokens=end - start))
            assert again.response_ids[0] == out.response_ids[start:end]
        full = torch.tensor([sample.prompt_ids + out.response_ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=full).logits[0, :-1].float(), -1)
        targets = full[0, 1:]
        recomputed = logprobs.gather(-1, targets[:, None])[:, 0][len(sample.prompt_ids) - 1:]
        mask = torch.tensor(out.response_mask, dtype=torch.bool)
        gap = (recomputed[mask] - torch.tensor(out.response_logprobs)[mask]).abs().max().item()
        # fp32: a KV-cached decode against one full forward, two kernels of the model (tests/tolerances.py;
        # measured <= 1/90 of it)
        tol = logprob_tol(model.config, full.shape[1])
        assert gap <= tol, (gap, tol)
        assert all(lp == 0.0 for lp, m in zip(out.response_logprobs, out.response_mask) if not m)


def test_rows_from_trajectories(runner: AgentRunner, engine) -> None:
    samples = _samples(runner, 2)
    prompts = Batch.from_dict({"prompt_index": torch.arange(2)}, meta={
        "prompt_ids": [s.prompt_ids for s in samples], "uid": ["a", "b"], "extra_info": [{"index": 0}, {"index": 1}],
        "messages": [s.messages for s in samples], "agent_name": ["echo_env", None]})
    P, R = 32, 90
    sampling = SamplingConfig(n=2, temperature=0.0, max_tokens=R)
    rows, meta = agent_generate(runner, engine, prompts, sampling, (P, R), pad_id=0, version=7, on_boundary=None)
    assert rows["input_ids"].shape == (4, P + R) and rows["step_rewards"].shape == (4, R)
    assert meta["uid"] == ["a", "a", "b", "b"]
    outs, _ = runner.run(engine, [samples[0], samples[0], samples[1], samples[1]],
                         ["echo_env", "echo_env", None, None], sampling)
    for i, out in enumerate(outs):
        n = len(out.response_ids)
        assert rows["input_ids"][i, P:P + n].tolist() == out.response_ids
        assert rows["attention_mask"][i, P:].sum().item() == n
        assert rows["response_mask"][i, :n].tolist() == [float(m) for m in out.response_mask]
        assert rows["response_mask"][i, n:].sum().item() == 0
        assert rows["token_version"][i, :n].tolist() == [7] * n
        expected = torch.zeros(R)
        for position, reward in out.step_rewards:
            expected[position] += reward
        assert torch.equal(rows["step_rewards"][i], expected)
    # echo_env rows (the first prompt's): 3 turns, its extra for the reward function; default rows: 1 turn
    assert [e["num_turns"] for e in meta["extra_info"]] == [3, 3, 1, 1]
    assert [e["finish_reason"] for e in meta["extra_info"]] == [o.finish_reason for o in outs]
    assert meta["extra_info"][0]["env"] == "echo" and "env" not in meta["extra_info"][2]
    assert [m["agent/num_turns"] for m in meta["agent_metrics"]] == [3.0, 3.0, 1.0, 1.0]


def test_a_slow_environment_does_not_hold_back_the_others(runner: AgentRunner, engine) -> None:
    """Sample 0's first tool call returns only after the three others finished all their turns: a scheduler
    that waited for it (turn-synchronous rounds) would time out after 60 s instead."""
    cls = agent_loop_class("echo_env")
    cls.blocked, cls._open = {0}, None
    try:
        outs, stats = runner.run(engine, _samples(runner, 4), ["echo_env"] * 4, GREEDY)
    finally:
        cls.blocked, cls._open = set(), None
    assert all(o.num_turns == 3 for o in outs)
    # The blocked one's later turns ran alone, after the others were done.
    assert stats.requests == 12 and stats.batch_sizes[0] == 4 and stats.batch_sizes[-2:] == [1, 1], stats.batch_sizes


def test_a_failing_loop_is_named_and_bad_outputs_are_refused(runner: AgentRunner, engine) -> None:
    with pytest.raises(RuntimeError, match=r"agent loop 'broken_env' failed on sample 0 .*KeyError: 'no such board'"):
        runner.run(engine, _samples(runner, 2), ["broken_env", None], GREEDY)
    bad = AgentLoopOutput([1, 2], [3, 4, 5], [1, 1], [0.0, 0.0, 0.0], num_turns=1)
    with pytest.raises(RuntimeError, match="agent loop 'x' returned 2 response_mask entries for 3 response tokens"):
        bad.check("x", 8, 8)
    too_long = AgentLoopOutput([1], [3] * 9, [1] * 9, [0.0] * 9, num_turns=1)
    with pytest.raises(RuntimeError, match="returned 9 response tokens > data.max_response_length=8"):
        too_long.check("x", 8, 8)


def test_loop_config_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="agent_loop_config_path=.*: no such file"):
        load_agent_loop_config(str(tmp_path / "missing.yaml"))
    (tmp_path / "a.yaml").write_text("- name: x\n  _target_: json.JSONDecoder\n")
    with pytest.raises(ValueError, match="json.JSONDecoder is not a subclass of rlsp.agent.loop.AgentLoop"):
        load_agent_loop_config(str(tmp_path / "a.yaml"))
    (tmp_path / "b.yaml").write_text("- name: x\n  _target_: no_such_pkg.Loop\n")
    with pytest.raises(ValueError, match="cannot import 'no_such_pkg'"):
        load_agent_loop_config(str(tmp_path / "b.yaml"))
    (tmp_path / "c.yaml").write_text("tools: []\n")
    with pytest.raises(ValueError, match="expected a YAML list of"):
        load_agent_loop_config(str(tmp_path / "c.yaml"))
    with pytest.raises(ValueError, match=r"unknown agent loop 'nope'; registered: \[.*'single_turn_agent'.*'tool_agent'"):
        agent_loop_class("nope")
