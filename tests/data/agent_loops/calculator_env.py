"""An environment loop for tests: after every policy turn the environment checks the row's sum with the
calculator tool and reports the result as a tool message, so every trajectory has tool turns whatever a
random-init model writes. Three policy turns; the calculator's step reward is kept per turn."""

from __future__ import annotations

from rlsp.agent.loop import AgentLoop, AgentLoopOutput, AgentSample
from rlsp.agent.tools.session import ToolSession
from rlsp.agent.types import ToolCall

TURNS = 3
TURN_TOKENS = 4


class CalculatorEnv(AgentLoop):
    async def run(self, sample: AgentSample) -> AgentLoopOutput:
        env, info = self.env, sample.extra_info
        session = ToolSession(env.tools, sample.tools_kwargs, timeout_s=5.0, max_response_chars=32,
                              truncate_side="right", max_parallel_calls=1)
        end = min(env.chat.end_of_turn_ids())
        ids, mask, lps, versions, steps, turns = [], [], [], [], [], 0
        try:
            while turns < TURNS and (left := sample.max_response_tokens - len(ids)) > 0:
                gen = await env.server.generate(sample.prompt_ids + ids, min(TURN_TOKENS, left))
                ids, mask, lps = ids + gen.ids, mask + [1] * len(gen.ids), lps + gen.logprobs
                versions += [gen.version] * len(gen.ids)
                turns += 1
                if turns == TURNS:
                    break
                call = ToolCall("calculator", {"expression": f"{info['a']} {info['op']} {info['b']}"})
                async with env.server.tool_call():
                    (result,) = await session.call([call])
                steps.append((len(ids) - 1, result.reward))
                closing = [] if gen.ids and gen.ids[-1] == end else [end]
                obs = closing + env.chat.observation_ids([{"role": "tool", "name": result.name, "content": result.text}])
                obs = obs[: sample.max_response_tokens - len(ids)]
                ids, mask, lps = ids + obs, mask + [0] * len(obs), lps + [0.0] * len(obs)
                versions += [gen.version] * len(obs)
        finally:
            await session.close()
        return AgentLoopOutput(list(sample.prompt_ids), ids, mask, lps, num_turns=turns, token_versions=versions,
                               step_rewards=steps, metrics={"agent/tool_calls": float(len(steps))},
                               extra={"tool_results": len(steps)})
