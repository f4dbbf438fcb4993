"""GenerationServer: agent loops ask for one continuation at a time; the engine serves them in batches.

Agent loops are coroutines on an event loop in a thread of their own (`rlsp.agent.runner`); the engine
stays on the caller's thread (vLLM and CUDA are driven from there as in single-turn rollouts). Each
`generate` request waits in a queue; when the engine is free, `serve` takes the waiting requests and
generates them together (one engine call per distinct `max_tokens`), so while one trajectory waits for
a slow tool the others keep the engine busy. A batch starts once every live trajectory is either
waiting for the engine or inside a tool call (`tool_call()`), or GATHER_S after its first request. When
some are inside tools, the batch is held open a little longer for them: TOOL_GRACE_S, or HOLD_FRACTION
of the last engine call's duration if that is longer. An engine call costs about the same for one
request as for many (decoding is step-bound), so holding for part of a call costs at most that part
and saves a whole call whenever a returning trajectory joins; a slow tool never holds a batch for
longer. `ServeStats` measures the engine's busy time and its idle time (waiting or holding).

Seeds: with a seeded sampling config, engine call k uses seed + k x SEED_STRIDE. Which requests share a
call depends on when tools finish, so seeded multi-turn sampling is reproducible only when tool timing
is (greedy decoding always is).

Images: a trajectory whose prompt carries images (a vision-language row's `multi_modal_inputs`) has them in
`TRAJECTORY_IMAGES`, which the runner sets in the trajectory's task; every continuation it asks for is generated
with them (the engine's prefill runs the vision tower on them for the prompt's image tokens, rlsp.rollout.hf_vision),
so loops keep calling `generate(ids, max_tokens)` and tool output stays text.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from rlsp.rollout.base import RolloutEngine, SamplingConfig

SEED_STRIDE = 1_000_003  # far apart: the requests of one call use seed .. seed + requests - 1
GATHER_S = 0.05  # the longest a waiting request holds the engine back for others still being prepared
TOOL_GRACE_S = 0.005  # ... and for tool calls that may return at once (a calculator takes microseconds)
HOLD_FRACTION = 0.5  # ... and up to this fraction of the last engine call for trajectories still in tools
# The images of the trajectory running in the current task (None: a text prompt); see the module docstring.
TRAJECTORY_IMAGES: contextvars.ContextVar[Any] = contextvars.ContextVar("rlsp_trajectory_images", default=None)


@dataclass(frozen=True)
class Generation:
    """One continuation: the sampled ids, their logprobs, why it stopped and the policy version that made it."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (end-of-turn/EOS) or "length" (max_tokens reached)
    version: int


@dataclass
class ServeStats:
    calls: int = 0  # engine generate calls
    requests: int = 0  # continuations served
    busy_s: float = 0.0  # time inside engine calls
    idle_s: float = 0.0  # time between engine calls: no request waiting (all in tools), or a batch held open
    batch_sizes: list[int] = field(default_factory=list)


@dataclass
class _Request:
    ids: list[int]
    max_tokens: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    images: Any = None  # the trajectory's multi_modal_inputs entry (None: no image)


class GenerationServer:
    def __init__(self, sampling: SamplingConfig, version: int = 0) -> None:
        self.sampling = replace(sampling, n=1)
        self.version = version
        self._cond = threading.Condition()
        self._pending: list[_Request] = []
        self._finished = False
        self._live = 0  # trajectories started and not yet returned
        self._in_tools = 0  # of them, inside a tool call
        self._last_call_s = 0.0  # duration of the last engine call

    def started(self, n: int = 1) -> None:
        with self._cond:
            self._live += n

    def ended(self) -> None:
        with self._cond:
            self._live -= 1
            self._cond.notify()

    def tool_call(self) -> _InTools:
        """`async with server.tool_call():` around tool execution, so batches do not wait for it."""
        return _InTools(self)

    def _tools(self, delta: int) -> None:
        with self._cond:
            self._in_tools += delta
            self._cond.notify()

    async def generate(self, ids: list[int], max_tokens: int) -> Generation:
        """Continue `ids` by at most `max_tokens` tokens (called by agent loops)."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens}: a continuation needs at least one token")
        loop = asyncio.get_running_loop()
        request = _Request(list(ids), int(max_tokens), loop.create_future(), loop, TRAJECTORY_IMAGES.get())
        with self._cond:
            if self._finished:
                raise RuntimeError("the generation server has stopped")
            self._pending.append(request)
            self._cond.notify()
        return await request.future

    def finish(self) -> None:
        """No more requests will come (every agent loop has returned): `serve` returns."""
        with self._cond:
            self._finished = True
            self._cond.notify()

    def abort(self) -> None:
        """The loops failed: drop waiting requests and stop serving."""
        self._take_all()
        with self._cond:
            self._cond.notify()

    def serve(self, engine: RolloutEngine, on_boundary: Callable[[], int] | None = None) -> ServeStats:
        """Run on the engine's thread until `finish`: batch waiting requests into engine calls."""
        stats = ServeStats()
        while (batch := self._next_batch(stats)) is not None:
            if on_boundary is not None:  # a turn boundary: newer weights may be picked up here
                self.version = on_boundary()
            t0 = time.perf_counter()
            try:
                self._run_batch(engine, batch, stats)
            except BaseException as exc:
                self._fail(batch + self._take_all(), exc)
                raise
            stats.busy_s += time.perf_counter() - t0
        return stats

    def _next_batch(self, stats: ServeStats) -> list[_Request] | None:
        t0 = time.perf_counter()
        with self._cond:
            while not self._pending and not self._finished:
                self._cond.wait()
            if not self._pending:
                stats.idle_s += time.perf_counter() - t0
                return None
            start = time.perf_counter()
            while (left := self._gather_left(time.perf_counter() - start)) > 0:
                self._cond.wait(left)
            stats.idle_s += time.perf_counter() - t0  # waiting for requests, and holding a batch open
            batch, self._pending = self._pending, []
            return batch

    def _gather_left(self, waited: float) -> float:
        """How much longer the first waiting request holds the batch open (<= 0: start now)."""
        if len(self._pending) + self._in_tools < self._live:
            return GATHER_S - waited  # some trajectory is still being prepared
        if self._in_tools:
            # All accounted for, some in tools. A call costs about the same for one request as for many
            # (decoding is step-bound), so holding the batch for part of a call's time to let returning
            # trajectories join costs at most that part, and saves a whole call when they come.
            return max(TOOL_GRACE_S, HOLD_FRACTION * self._last_call_s) - waited
        return 0.0

    def _take_all(self) -> list[_Request]:
        with self._cond:
            self._finished = True
            rest, self._pending = self._pending, []
            return rest

    def _run_batch(self, engine: RolloutEngine, batch: list[_Request], stats: ServeStats) -> None:
        # One engine call per distinct max_tokens (an engine call has one sampling config).
        for max_tokens in sorted({r.max_tokens for r in batch}):
            group = [r for r in batch if r.max_tokens == max_tokens]
            seed = None if self.sampling.seed is None else self.sampling.seed + stats.calls * SEED_STRIDE
            t0 = time.perf_counter()
            images = {"images": [r.images for r in group]} if any(r.images is not None for r in group) else {}
            out = engine.generate([r.ids for r in group], replace(self.sampling, max_tokens=max_tokens, seed=seed),
                                  **images)
            self._last_call_s = time.perf_counter() - t0
            stats.calls += 1
            stats.requests += len(group)
            stats.batch_sizes.append(len(group))
            for j, request in enumerate(group):
                result = Generation(out.response_ids[j], out.response_logprobs[j], out.finish_reason[j], self.version)
                _deliver(request, _resolve, result)

    @staticmethod
    def _fail(requests: list[_Request], exc: BaseException) -> None:
        error = RuntimeError(f"the rollout engine failed: {type(exc).__name__}: {exc}")
        for request in requests:
            _deliver(request, _reject, error)


class _InTools:
    def __init__(self, server: GenerationServer) -> None:
        self.server = server

    async def __aenter__(self) -> None:
        self.server._tools(+1)

    async def __aexit__(self, *exc: object) -> None:
        self.server._tools(-1)


def _deliver(request: _Request, how: Callable[[asyncio.Future, object], None], value: object) -> None:
    try:
        request.loop.call_soon_threadsafe(how, request.future, value)
    except RuntimeError:  # the loops' event loop is closed: they failed and nobody waits for this answer
        pass


def _resolve(future: asyncio.Future, value: Generation) -> None:
    if not future.done():
        future.set_result(value)


def _reject(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
