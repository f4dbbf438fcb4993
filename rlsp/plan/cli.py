"""The layout planner's command line (run as `python -m rlsp.plan`, rlsp/plan/__main__.py):
`python -m rlsp.plan --model <dir> --gpus-per-node N --nodes M --gpu-memory-gib G --seq-len L`.

Reads the model's config.json, lists the training layouts that fit (dp x ring x Ulysses x tp, with or
without sequence-parallel activations, FSDP shard groups, activation checkpointing, the token budget
per GPU) with the estimated memory per GPU and communication per layer, marks the recommended one
and says why each of the others loses; explains layouts it refuses or replaces. With `--overrides`
the last line printed is exactly the Hydra overrides of the recommended plan for
`python -m rlsp.main --config-name grpo` (or ppo). Exit codes: 0 a plan, 2 no layout fits or bad input.
When nothing fits, the answer names the longest length that does on these GPUs (binary search). A
length beyond the model's max_position_embeddings is capped there (rlsp.check refuses longer runs and
rlsp does not override config.json entries) and the answer says so.

Models: the other modules of rlsp/plan/ (memory, communication, enumeration; no torch). Numbers and their checks
against measured peaks: docs/plan.md and docs/benchmarks.md ("Planner memory model").
"""

from __future__ import annotations

import argparse
import sys

from rlsp.config.model_shape import read_model_shape
from rlsp.parallel.heads import plan_head_layout
from rlsp.plan.comm import HeadSplit
from rlsp.plan.explain import fsdp_name, infeasible, layout_name, loss_reason, refusals, settings_name
from rlsp.plan.longest import longest_length
from rlsp.plan.memory import GIB
from rlsp.plan.overrides import (
    LEAN_NORM_KEY,
    OFFLOAD_KEY,
    PARAM_OFFLOAD_KEY,
    TILED_KEY,
    RunShape,
    batch_sizes,
    overrides,
    rollout_note,
    schema_has,
)
from rlsp.plan.search import Cluster, Plan, Request, Speeds, search

MB = 1e6


def head_split(q_heads: int, kv_heads: int, ulysses: int) -> HeadSplit:
    """The runtime's Ulysses head plan (uneven splits, kv replication), as the planner needs it."""
    layout = plan_head_layout(q_heads, kv_heads, ulysses)
    return HeadSplit(layout.q_counts, layout.kv_counts)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rlsp.plan", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="model directory with config.json (or the file)")
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu-memory-gib", type=float, required=True)
    p.add_argument("--seq-len", type=int, required=True, help="longest sequence: prompt + response tokens")
    p.add_argument("--prompt-len", type=int, default=None, help="data.max_prompt_length (default min(1024, L/4))")
    p.add_argument("--algo", choices=("grpo", "ppo"), default="grpo", help="ppo adds a colocated critic")
    p.add_argument("--critic", action="store_true", help="a colocated critic (PPO's value model): same as --algo ppo")
    p.add_argument("--no-reference", action="store_true", help="actor only: no reference model (emits "
                   "actor.use_kl_loss=false and algorithm.use_kl_in_reward=false)")
    p.add_argument("--host-memory-gib", type=float, default=1024.0, help="host memory per node for offloaded "
                   "parameters, optimizer state and activations (default 1024)")
    p.add_argument("--pcie-gbps", type=float, default=25.0, help="GB/s between a GPU and host memory (offload copies)")
    p.add_argument("--logprob-chunk", type=int, default=1024, help="tokens per chunk of the logprob head "
                   "(actor.logprob_chunk_size, default 1024)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="compute dtype")
    p.add_argument("--max-budget", type=int, default=32768, help="largest token budget per GPU tried (default 32768)")
    p.add_argument("--headroom", type=float, default=0.10, help="fraction of GPU memory kept free (default 0.10)")
    p.add_argument("--train-batch-size", type=int, default=None, help="prompts per step (default: >= 16, a multiple of the GPUs)")
    p.add_argument("--rollout-n", type=int, default=8, help="samples per prompt")
    p.add_argument("--tflops", type=float, default=300.0, help="sustained TFLOP/s per GPU for the time estimate")
    p.add_argument("--intra-gbps", type=float, default=300.0, help="GB/s per GPU inside a node")
    p.add_argument("--inter-gbps", type=float, default=40.0, help="GB/s per GPU between nodes")
    p.add_argument("--top", type=int, default=12, help="layouts listed (default 12); --all lists every one")
    p.add_argument("--all", action="store_true")
    p.add_argument("--no-flash-attn", action="store_true", help="GPUs without flash_attn: windowed and soft-capped "
                   "layers run rlsp's torch banded kernel, which keeps O(tokens x window) probabilities for backward")
    p.add_argument("--image-tokens", type=int, default=0, help="image tokens per sequence of vision-language data "
                   "(its prompt's images); the vision tower's activations are counted for them (default 0: text)")
    p.add_argument("--overrides", action="store_true", help="print the recommended plan's Hydra overrides last")
    return p.parse_args(argv)


def build_request(a: argparse.Namespace) -> tuple[Request, RunShape]:
    for name in ("gpus_per_node", "nodes", "seq_len", "rollout_n", "max_budget", "logprob_chunk"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(a, name)} must be >= 1")
    for name in ("gpu_memory_gib", "host_memory_gib", "pcie_gbps"):
        if getattr(a, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(a, name)} must be > 0")
    if not 0 <= a.headroom < 1:
        raise ValueError(f"--headroom={a.headroom} must be in [0, 1)")
    shape = read_model_shape(a.model)
    seq = min(a.seq_len, shape.max_positions or a.seq_len)  # capped: see position_note
    prompt = a.prompt_len if a.prompt_len is not None else min(1024, seq // 4)
    if not 1 <= prompt < seq:
        raise ValueError(f"--prompt-len={prompt} must be in [1, {seq - 1}] (the response gets the rest of --seq-len)")
    if a.image_tokens and (shape.vision is None or not 0 < a.image_tokens <= prompt):
        raise ValueError(f"--image-tokens={a.image_tokens}: legal: 0, or 1..--prompt-len ({prompt}) for a "
                         f"vision-language model (qwen2_5_vl, qwen3_vl, qwen3_vl_moe); {a.model} is a {shape.model_type}")
    algo = "ppo" if a.critic else a.algo
    cluster = Cluster(a.nodes, a.gpus_per_node, a.gpu_memory_gib, a.headroom, a.host_memory_gib)
    req = Request(shape, cluster, seq, critic=algo == "ppo", dtype_bytes=2 if a.dtype == "bfloat16" else 4,
                  max_budget=a.max_budget, logprob_chunk=a.logprob_chunk,
                  speeds=Speeds(a.tflops, a.intra_gbps, a.inter_gbps, a.pcie_gbps),
                  tiled_mlp=schema_has(TILED_KEY), activation_offload=schema_has(OFFLOAD_KEY),
                  reference=not a.no_reference, param_offload=schema_has(PARAM_OFFLOAD_KEY),
                  lean_norm=schema_has(LEAN_NORM_KEY), flash=not a.no_flash_attn, image_tokens=a.image_tokens)
    run = RunShape(a.model, prompt, seq - prompt, 0, 0, a.rollout_n, algo)
    return req, run


def position_note(asked: int, req: Request) -> str | None:
    """Why the planned length is shorter than the one asked for, when it is."""
    if asked <= req.seq_len:
        return None
    return (f"--seq-len={asked} exceeds the model's max_position_embeddings={req.shape.max_positions}: planned at "
            f"{req.seq_len} tokens. rlsp.check refuses longer runs and rlsp does not override config.json entries "
            "(model.override_config); to train longer, give the model a config.json whose max_position_embeddings "
            "(and rope_scaling) cover the length")


def _row(i: int, plan: Plan, verdict: str, layers: int) -> str:
    s, c = plan.settings, plan.comm
    names = ["ckpt"] * s.checkpointing + ["offload"] * s.activation_offload + \
        [f"tiled{s.tiled_mlp_shards}"] * bool(s.tiled_mlp_shards) + ["paramoff"] * s.param_offload + \
        ["lean"] * s.lean_norm
    opts = "+".join(names) or "-"
    comm = f"{c.intra / layers / MB:>9,.0f} {c.inter / layers / MB:>9,.0f}"
    return (f"{i:>3}  {layout_name(plan.layout):<40} {fsdp_name(plan.layout):<8} {opts:<29} {s.budget:>8} "
            f"{plan.memory.peak / GIB:>7.1f} {comm} {plan.throughput:>9,.0f}  {verdict}")


def print_plans(req: Request, plans: list[Plan], limit: int) -> None:
    print(f"{'#':>3}  {'layout':<40} {'FSDP':<8} {'options':<29} {'tok/GPU':>8} {'GiB/GPU':>7} "
          f"{'MB intra':>9} {'MB inter':>9} {'tok/s/GPU':>9}  verdict")
    best = plans[0] if plans[0].fits else None
    for i, plan in enumerate(plans[:limit], 1):
        verdict = "RECOMMENDED" if plan is best else loss_reason(plan, best or plan, req)
        print(_row(i, plan, verdict, req.shape.layers))
    rest = plans[limit:]
    if rest:
        print(f"     ... {len(rest)} more layouts ({sum(p.fits for p in rest)} fit); --all lists them")


def print_header(req: Request, run: RunShape) -> None:
    c, sp = req.cluster, req.speeds
    ref = " + reference" if req.reference else " only (no reference: KL loss and KL in the reward off)"
    roles = f"actor{ref} + critic (PPO, colocated)" if req.critic else f"actor{ref} (GRPO)"
    print(req.shape.describe())
    print(f"cluster: {c.nodes} node(s) x {c.gpus_per_node} GPUs of {c.gpu_memory_gib:g} GiB ({c.usable / GIB:.1f} GiB "
          f"usable after {c.headroom:.0%} headroom); sequences of {req.seq_len} tokens (prompt {run.prompt_len} + "
          f"response {run.response_len}); {roles}; compute {'bf16' if req.dtype_bytes == 2 else 'fp32'}")
    print(f"speed model (ranking only): {sp.tflops:g} TFLOP/s per GPU, {sp.intra_gbps:g} GB/s inside a node, "
          f"{sp.inter_gbps:g} GB/s between nodes, {sp.host_gbps:g} GB/s to host memory ({c.host_memory_gib:g} GiB per "
          "node), communication not overlapped; MB = per layer and micro-batch sent by one GPU")
    missing = [k for k in (TILED_KEY, OFFLOAD_KEY, PARAM_OFFLOAD_KEY, LEAN_NORM_KEY) if not schema_has(k)]
    if missing:
        print(f"not available in this version (not enumerated): {', '.join(missing)}")


def print_recommended(req: Request, plans: list[Plan], best: Plan) -> None:
    fitting = sum(p.fits for p in plans)
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in best.memory.terms.items() if v >= 0.05 * GIB)
    print(f"\nrecommended: {layout_name(best.layout)}, FSDP {fsdp_name(best.layout)}, {settings_name(best)}, "
          f"{best.settings.budget} tokens per GPU: the highest "
          f"estimated throughput of the {fitting} fitting layouts ({best.throughput:,.0f} tokens/s per GPU)")
    print(f"memory per GPU: {best.memory.peak / GIB:.1f} GiB at the {best.memory.phase} "
          f"(GiB: {parts})")
    if best.host:
        print(f"host memory per node: {best.host / GIB:.1f} GiB of {req.cluster.host_usable / GIB:.1f} usable "
              "(offloaded parameters, gradients, optimizer state and activations)")


def print_longest(req: Request) -> None:
    """When nothing fits: the longest length that does on these GPUs, and its plan."""
    found = longest_length(req, head_split)
    gpus = req.cluster.world.world_size
    if found is None:
        print(f"longest length that fits on {gpus} GPUs: none (not even 1024 tokens)", file=sys.stderr)
        return
    length, plan = found
    print(f"longest length that fits on {gpus} GPUs: {length} tokens ({layout_name(plan.layout)}, FSDP "
          f"{fsdp_name(plan.layout)}, {settings_name(plan)}, {plan.memory.peak / GIB:.1f} GiB per GPU)", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        req, run = build_request(a)
        plans = search(req, head_split)
        capped = position_note(a.seq_len, req)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print_header(req, run)
    print_plans(req, plans, len(plans) if a.all else a.top)
    lines = refusals(req, plans)
    if lines:
        print("\nrefused or replaced:")
        print("\n".join(f"  {line}" for line in lines))
    best = plans[0]
    if capped:
        print(f"\nnote: {capped}")
    if not best.fits:
        print(f"\nerror: {infeasible(req, plans)}", file=sys.stderr)
        print_longest(req)
        return 2
    print_recommended(req, plans, best)
    batch, mini = batch_sizes(req.cluster.world.world_size, best.layout.dp_size, run.rollout_n, a.train_batch_size)
    run = RunShape(run.model_path, run.prompt_len, run.response_len, batch, mini, run.rollout_n, run.algo)
    keys = overrides(req, best, run)
    note = rollout_note(req, best)
    if note:
        print(f"note: {note}")
    if "trainer.sp_self_check=false" in keys:
        print("note: the start-up self-check (an unsharded forward of a dp rank's whole batch) would not fit: "
              "trainer.sp_self_check=false")
    if a.overrides:
        print(f"\npython -m rlsp.main --config-name {run.algo} <these overrides>:")
        print(" ".join(keys))
    return 0
