"""Start-up check of the GPU memory fractions of the vLLM engines that are awake together on one device.

A policy worker's device can host two vLLM engines: the rollout engine
(`actor_rollout_ref.rollout.gpu_memory_utilization`, in the worker's process) and verl's reward loop
(`reward_model.use_reward_loop=true`, `reward_model.rollout.gpu_memory_utilization`: in the worker's
process, or with `reward_servers` in a process of its own beside the worker, on the same device).
What vLLM does with the fraction (0.32, vllm/v1/worker/utils.py `request_memory`, gpu_worker.py):
- at start-up an engine refuses to start when the device's free memory (every process counted) is
  below fraction x total ("Free memory on device ... is less than desired GPU memory utilization");
  otherwise it takes that whole budget: weights, activations, and a KV cache filling the rest;
- asleep (level 1, GPU only) an engine holds none of it (weights copied to host, KV cache dropped);
  `wake_up` maps the whole budget back, with no check: a device without room fails out of memory.
So two engines that are awake at the same moment need the sum of their fractions (plus the training
state already resident: actor, reference and a colocated critic) of the device; one asleep costs nothing.

When both are awake on one device:
- Start-up, as verl starts them (its reward-loop examples run 0.8 beside a rollout of 0.5-0.7): each
  engine starts while the other sleeps. rlsp's worker builds the rollout engine first, puts it to sleep
  (verl's "trainer mode"), then builds the training roles and the reward engine; with
  `reward_model.rollout.free_cache_engine=true` the reward engine sleeps once built. Reward servers start
  after every worker's `init_worker`, which ends with the rollout engine asleep again (after a first
  weight sync, if any). A start needs only its own fraction beside the training state.
  rlsp/workers/worker.py does that: it puts the rollout engine to sleep right after building it and
  again after the start-up weight sync (an engine left awake would make every reward start need the sum).
- A step: `generate` wakes the rollout engine and puts it to sleep when done; scoring comes after it
  and wakes the reward engine, which sleeps again after each call with free_cache_engine=true; the
  weight sync at the end of the step wakes the rollout engine until the next `generate`, with the
  reward engine asleep. Ray runs a worker's calls one at a time, and the driver waits for generation
  before scoring, so a reward server's call never overlaps its worker's generation either.
- `reward_model.rollout.free_cache_engine=false`: the reward engine never sleeps, so the rollout
  engine's every wake-up (weight sync, generation) needs its fraction beside the reward engine's:
  refused when the sum is over 1.
Not on one device, so not summed: a rollout pool of its own (async training; the rollout engines run on
the pool's devices, the reward engine on the trainer's), and HF generate (no vLLM rollout engine).
On `trainer.device=cpu` the fractions mean nothing (KV caches come from `*cpu_kvcache_space_gib`) and are
not checked; `auto` is checked, as it runs on CUDA wherever a GPU is present.
The training state: the planner (rlsp.plan.memory.state_bytes) gives it in bytes per rank from
the model's config.json, but the config has no key for the device's size to turn it into a fraction
(the planner takes `--gpu-memory-gib` on its command line), so only the fractions are summed and the
error says the training state comes on top.
"""

from __future__ import annotations

import math
from typing import Any

from rlsp.config.layout import ParallelLayout

ROLLOUT_KEY = "actor_rollout_ref.rollout.gpu_memory_utilization"
REWARD_KEY = "reward_model.rollout.gpu_memory_utilization"
FREE_KEY = "reward_model.rollout.free_cache_engine"


def _fraction(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value <= 1


def _headroom(other: float) -> float:
    """The largest fraction (two decimals) that fits beside `other` on one device."""
    return math.floor((1.0 - other) * 100 + 1e-6) / 100


def _awake_together(cfg: Any, layout: ParallelLayout) -> str | None:
    """When the rollout and reward engines of one device are awake at once (see the module docstring), or None."""
    if layout.reward_model is None or not cfg.reward_model.use_reward_loop:
        return None
    if layout.rollout is not None or cfg.actor_rollout_ref.rollout.name != "vllm":
        return None  # the rollout engines run on a pool of their own, or there is no vLLM rollout engine
    if not cfg.reward_model.rollout.free_cache_engine:
        where = "in a process of its own beside each policy worker, on the worker's GPU" if layout.reward_servers \
            else "in each policy worker's process"
        return (f"with {FREE_KEY}=false the reward engine ({where}) never sleeps, and the rollout engine wakes "
                "beside it for every weight sync and generation")
    return None


def _sum_error(device: str, rollout: float, reward: float, moment: str) -> str:
    total = rollout + reward
    fixes = [f"lower {REWARD_KEY} to <= {_headroom(rollout):g}" if _headroom(rollout) > 0 else "",
             f"lower {ROLLOUT_KEY} to <= {_headroom(reward):g}" if _headroom(reward) > 0 else "",
             f"set {FREE_KEY}=true (the reward engine sleeps between scoring calls, verl's default)"]
    return (f"{REWARD_KEY}={reward:g} + {ROLLOUT_KEY}={rollout:g} = {total:g} > 1 of a GPU (trainer.device={device}): "
            f"{moment}; each awake vLLM engine holds its fraction of the device's total memory, so the rollout "
            f"engine's wake-up runs out of memory, and the training state (actor, reference and a colocated "
            f"critic: weights, gradients, optimizer state) comes on top of the sum; legal: "
            + ", or ".join(f for f in fixes if f))


def check_gpu_memory(cfg: Any, layout: ParallelLayout | None, errors: list[str]) -> None:
    """On a CUDA run (device cuda or auto): the engines' fractions are in (0, 1], and those awake together
    on one device sum to at most 1."""
    device = cfg.trainer.device
    if device not in ("cuda", "auto"):
        return
    rollout, reward = cfg.actor_rollout_ref.rollout.gpu_memory_utilization, cfg.reward_model.rollout.gpu_memory_utilization
    if cfg.actor_rollout_ref.rollout.name == "vllm" and not _fraction(rollout):
        errors.append(f"{ROLLOUT_KEY}={rollout!r} must be a fraction in (0, 1] (of the GPU's total memory the "
                      "rollout engine takes while awake)")
        return
    if layout is None or not _fraction(reward):  # the reward loop's own check names a bad fraction
        return
    moment = _awake_together(cfg, layout)
    if moment is not None and rollout + reward > 1 + 1e-9:
        errors.append(_sum_error(device, rollout, reward, moment))
