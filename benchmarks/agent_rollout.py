"""Multi-turn rollout wall time under long-tailed tool latency: rlsp's batching server against turn-synchronous
rounds, on a real engine (HF generate or vLLM, the built-in tiny model, CPU).

Each of N trajectories runs K policy turns of at most T tokens; between turns it calls a "remote tool"
whose latency is drawn from a lognormal distribution (median `--median-s`, shape `--sigma`: a long
tail). `mode=rlsp` runs the loops as rlsp does (a trajectory's next turn joins the next engine batch as
soon as its tool returns); `mode=rounds` makes every trajectory wait for the slowest tool of the turn
before anyone generates again (what a turn-by-turn batched rollout does). The latencies are the same
draws in both modes. Lower bound on wall time: max(engine busy time, the longest sum of one trajectory's
tool latencies + its share of generation), printed as `bound_s`; `wall_over_bound` says how close a mode
gets. One JSON line per mode.

    python benchmarks/agent_rollout.py [--engine hf|vllm] [--device cpu|cuda] [--trajectories 32] [--turns 4]
        [--tokens 16] [--median-s 0.05] [--sigma 1.5]

With the hf engine each line also reports `logprob_gap_max`: the engine's logprobs of the policy tokens
against one full forward of each whole trajectory (what the trainer recomputes), on the engine's device.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, without installing rlsp

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from rlsp.agent.loop import AgentLoop, AgentLoopOutput, AgentSample, register_agent_loop  # noqa: E402
from rlsp.agent.runner import AgentRunner  # noqa: E402
from rlsp.config.schema_rollout import MultiTurnConfig, RolloutConfig  # noqa: E402
from rlsp.models.tiny import TinyModelSpec, ensure_tiny_model  # noqa: E402
from rlsp.rollout import SamplingConfig, build_rollout_engine  # noqa: E402

# fp32 engine logprobs (decoding with a KV cache) against one full forward: CPU kernels agree to ~5e-7;
# CUDA's decode and prefill kernels differ more.
LOGPROB_TOL = {"cpu": 1e-5, "cuda": 1e-3}


class _LazyBarrier:
    """An asyncio.Barrier made on first use: it belongs to the event loop of the run that uses it."""

    def __init__(self, parties: int) -> None:
        self.parties, self._barrier = parties, None

    async def wait(self) -> None:
        if self._barrier is None:
            self._barrier = asyncio.Barrier(self.parties)
        await self._barrier.wait()


class _Rounds:
    """Turn barrier shared by the loops in `rounds` mode (None: rlsp mode)."""

    barrier: _LazyBarrier | None = None


@register_agent_loop("bench_remote_tool")
class RemoteToolLoop(AgentLoop):
    latencies: dict[int, list[float]] = {}
    turns, tokens = 4, 16

    async def run(self, sample: AgentSample) -> AgentLoopOutput:
        chat, server, idx = self.env.chat, self.env.server, sample.extra_info["index"]
        end, ids, mask, lps = min(chat.end_of_turn_ids()), [], [], []
        for turn in range(self.turns):
            gen = await server.generate(sample.prompt_ids + ids, self.tokens)
            ids, mask, lps = ids + gen.ids, mask + [1] * len(gen.ids), lps + gen.logprobs
            if turn == self.turns - 1:
                break
            async with server.tool_call():
                await asyncio.sleep(self.latencies[idx][turn])
            if _Rounds.barrier is not None:
                await _Rounds.barrier.wait()
            obs = ([] if gen.ids[-1:] == [end] else [end]) + chat.observation_ids([{"role": "tool", "content": "ok"}])
            ids, mask, lps = ids + obs, mask + [0] * len(obs), lps + [0.0] * len(obs)
        return AgentLoopOutput(list(sample.prompt_ids), ids, mask, lps, num_turns=self.turns)


def _run(runner: AgentRunner, engine, samples: list[AgentSample], mode: str) -> tuple[float, object, list]:
    _Rounds.barrier = None
    if mode == "rounds":
        _Rounds.barrier = _LazyBarrier(len(samples))
    t0 = time.perf_counter()
    outs, stats = runner.run(engine, samples, ["bench_remote_tool"] * len(samples),
                             SamplingConfig(n=1, temperature=1.0, max_tokens=RemoteToolLoop.tokens * 2 + 64, seed=0))
    return time.perf_counter() - t0, stats, outs


@torch.no_grad()
def _logprob_gap(model: torch.nn.Module, samples: list[AgentSample], outs: list) -> float:
    """Largest |engine logprob - full-forward logprob| over the policy tokens of every trajectory (what the
    trainer recomputes): token-in/token-out on this device."""
    gap = 0.0
    device = next(model.parameters()).device
    for sample, out in zip(samples, outs):
        ids = torch.tensor([sample.prompt_ids + out.response_ids], device=device)
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        got = logprobs.gather(-1, ids[0, 1:, None])[:, 0][len(sample.prompt_ids) - 1:]
        mask = torch.tensor(out.response_mask, device=device, dtype=torch.bool)
        engine = torch.tensor(out.response_logprobs, device=device)
        gap = max(gap, float((got[mask] - engine[mask]).abs().max()))
    return gap


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    ap.add_argument("--device", default="cpu", help="the hf engine's device (cpu, cuda)")
    ap.add_argument("--trajectories", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--median-s", type=float, default=0.05)
    ap.add_argument("--sigma", type=float, default=1.5)
    args = ap.parse_args()
    RemoteToolLoop.turns, RemoteToolLoop.tokens = args.turns, args.tokens
    rng = random.Random(0)
    RemoteToolLoop.latencies = {i: [args.median_s * rng.lognormvariate(0, args.sigma) for _ in range(args.turns)]
                                for i in range(args.trajectories)}
    model = ensure_tiny_model(tempfile.mkdtemp(prefix="rlsp_bench_"), TinyModelSpec())
    budget = args.turns * (args.tokens + 24)
    engine = build_rollout_engine(args.engine, model, dtype="float32", seed=0, max_model_len=budget + 32,
                                  **({"enforce_eager": True} if args.engine == "vllm" else {"device": args.device}))
    rollout = OmegaConf.structured(RolloutConfig(multi_turn=MultiTurnConfig(enable=True)))
    runner = AgentRunner(rollout, AutoTokenizer.from_pretrained(model))
    samples = [AgentSample(runner.chat.prompt_ids([{"role": "user", "content": f"{i}+{i}="}]), None, budget,
                           extra_info={"index": i}) for i in range(args.trajectories)]
    _run(runner, engine, samples[:2], "rlsp")  # warm-up
    for mode in ("rlsp", "rounds"):
        wall, stats, outs = _run(runner, engine, samples, mode)
        gap = _logprob_gap(engine.model, samples, outs) if args.engine == "hf" else None
        longest_tools = max(sum(v[: args.turns - 1]) for v in RemoteToolLoop.latencies.values())
        bound = max(stats.busy_s, longest_tools + stats.busy_s / stats.calls * args.turns)
        print(json.dumps({"benchmark": "agent_rollout", "mode": mode, "engine": args.engine,
                          "trajectories": args.trajectories, "turns": args.turns, "tokens_per_turn": args.tokens,
                          "tool_median_s": args.median_s, "tool_sigma": args.sigma,
                          "tool_latency_sum_s": round(sum(sum(v[:-1]) for v in RemoteToolLoop.latencies.values()), 3),
                          "longest_trajectory_tools_s": round(longest_tools, 3), "wall_s": round(wall, 3),
                          "engine_busy_s": round(stats.busy_s, 3), "engine_idle_s": round(stats.idle_s, 3),
                          "engine_calls": stats.calls, "bound_s": round(bound, 3),
                          "wall_over_bound": round(wall / bound, 3), "device": args.device,
                          "logprob_gap_max": gap,
                          "ok": gap is None or gap <= LOGPROB_TOL[torch.device(args.device).type]}))


if __name__ == "__main__":
    main()
