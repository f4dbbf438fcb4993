"""Regenerate the "## Plans for public model shapes" section of docs/plan.md from the current planner.

Writes a config.json for each of five public model shapes (Qwen2.5-0.5B, Qwen2.5-7B, Qwen2.5-14B,
Llama-3.1-8B, Llama-3.1-70B: tests/data/public_model_shapes.json) into a temporary directory, runs the
section's `python -m rlsp.plan` commands there and rewrites the summary table, the longest-length table
against ALST's published lengths (the planner's binary search, run in this process), the full-output block
and the per-command subsections from what they print. The section's prose (the paragraph under its heading and
the "Columns:" paragraph) is kept as the doc has it; the section must be the last of the file. Running
it twice gives the same file. From the repository root:

    .venv/bin/python scripts/gen_plan_doc.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "plan.md"
HEADING = "## Plans for public model shapes\n"
SHAPES = json.loads((ROOT / "tests" / "data" / "public_model_shapes.json").read_text())  # also read by tests/unit/test_plan.py
# The arguments of each `python -m rlsp.plan` command, in the order of the table and the subsections.
COMMANDS = [
    "--model Qwen2.5-0.5B --nodes 1 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 32768 --overrides",
    "--model Qwen2.5-0.5B --nodes 1 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 1048576 --overrides",
    "--model Qwen2.5-7B --nodes 1 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 32768 --overrides",
    "--model Qwen2.5-7B --nodes 1 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 32768 --algo ppo --overrides",
    "--model Qwen2.5-7B --nodes 2 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 131072 --overrides",
    "--model Qwen2.5-14B --nodes 1 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 32768 --overrides",
    "--model Qwen2.5-14B --nodes 2 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 32768 --overrides",
    "--model Qwen2.5-14B --nodes 8 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 131072 --overrides",
    "--model Llama-3.1-8B --nodes 1 --gpus-per-node 1 --gpu-memory-gib 80 --seq-len 131072 --no-reference --overrides",
    "--model Llama-3.1-8B --nodes 1 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 131072 --overrides",
    "--model Llama-3.1-70B --nodes 1 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 32768 --overrides",
    "--model Llama-3.1-70B --nodes 8 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 32768 --overrides",
    "--model Llama-3.1-70B --nodes 8 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 131072 --overrides",
    "--model Llama-3.1-70B --nodes 1 --gpus-per-node 8 --gpu-memory-gib 24 --seq-len 32768 --overrides",
    "--model Llama-3.1-70B --nodes 1 --gpus-per-node 8 --gpu-memory-gib 24 --seq-len 32768 --host-memory-gib 2048 "
    "--overrides",
]
FULL_TITLE = "### Full output: Qwen2.5-7B, 32k tokens, 8 GPUs of 80 GiB"
FULL = COMMANDS[2]  # shown whole: Qwen2.5-7B, 32k, 1 x 8
TABLE_HEAD = ("| model | sequence | nodes x GPUs | algo | recommended | tokens/GPU | GiB/GPU | est. tokens/s/GPU |\n"
              "|---|---|---|---|---|---|---|---|")
SEQ = {"32768": "32k", "131072": "128k", "1048576": "1M"}
ROLLOUT_NOTE = " (training only: the rollout holds the whole model)"
# ALST (Arctic Long Sequence Training) published lengths for Llama-8B: (nodes, GPUs per node, tokens)
ALST = ((1, 1, 500_000), (1, 8, 3_700_000), (4, 8, 15_000_000))
BIG_HOST_GIB = 2048  # the last column: host memory per node where activation offload needs more than the default
ALST_TITLE = "### Longest trainable length, Llama-3.1-8B shape, bf16, 80 GiB GPUs"
ALST_INTRO = (
    "The planner's binary search (`rlsp.plan.longest.longest_length`, the length in steps of 1024 tokens; the "
    "same answer `python -m rlsp.plan` prints when nothing fits) for the Llama-3.1-8B shape without its "
    "position limit: its config.json allows 131,072 positions and rlsp plans and runs no more than that (rlsp "
    "does not override config.json entries), so lengths beyond it need a config.json whose "
    "max_position_embeddings and rope_scaling cover them. Actor-only: no reference model "
    "(`--no-reference`); GRPO with reference: the frozen reference's bf16 shards next to the actor. Host "
    "memory 1024 GiB per node (`--host-memory-gib`; the last column 2048), 10 % headroom on device and host: "
    "activation offload keeps every layer's input of a rank's stream in host memory, so at millions of tokens the "
    "host, not the GPU, can bound the length. Beside each length: "
    "the layout and options the planner picked, its peak per GPU; where ALST's length does not fit, the "
    "smallest estimate at ALST's length and the terms of its peak (GiB).")


def run(cwd: str, args: str) -> tuple[int, str, str]:
    """Run one planner command; returns (exit code, stdout, stderr)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "rlsp.plan", *args.split()], cwd=cwd, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": path})
    if proc.returncode not in (0, 2):
        sys.exit(f"python -m rlsp.plan {args}: exit {proc.returncode}\n{proc.stderr}")
    return proc.returncode, proc.stdout, proc.stderr


def block(*lines: str) -> str:
    return "\n".join(["```", *lines, "```"])


def describe(args: str) -> tuple[str, str, str, str]:
    """(model, sequence, cluster as in the titles, algo) of a command."""
    opt = dict(zip(args.split(), args.split()[1:]))  # each option name -> the word after it
    cluster = f"{opt['--nodes']} x {opt['--gpus-per-node']} GPUs of {opt['--gpu-memory-gib']} GiB"
    if "--host-memory-gib" in opt:
        cluster += f", {opt['--host-memory-gib']} GiB host memory"
    only = " actor-only" if "--no-reference" in opt else ""
    return opt["--model"], SEQ[opt["--seq-len"]], cluster, opt.get("--algo", "grpo").upper() + only


def table_row(args: str, code: int, out: str) -> str:
    model, seq, cluster, algo = describe(args)
    nodes, _, gib = cluster.split(",")[0].partition(" GPUs of ")
    cells = [model, seq, f"{nodes} ({gib})", algo]
    if code == 2:
        cells += ["no plan (exit 2)", "-", "-", "-"]
    else:
        rec = re.search(r"^recommended: (.*), (\d+) tokens per GPU: .*\(([\d,]+) tokens/s per GPU\)$", out, re.M)
        mem = re.search(r"^memory per GPU: ([\d.]+) GiB", out, re.M)
        layout = rec.group(1) + (ROLLOUT_NOTE if "\nnote: rollout:" in out else "")
        cells += [layout, rec.group(2), mem.group(1), rec.group(3)]
    return "| " + " | ".join(cells) + " |"


def subsection(args: str, code: int, out: str, err: str) -> str:
    model, seq, cluster, algo = describe(args)
    lines = out.splitlines()
    parts = [f"### {model}, {seq} tokens, {cluster}" + {"PPO": " (PPO)", "GRPO actor-only": " (actor only)"}.get(algo, ""),
             block(f"python -m rlsp.plan {args}")]
    if code == 2:
        parts += ["Exit code 2:", block(err.strip())]
    else:
        parts.append(block(*(line for line in lines if line.startswith(("recommended:", "memory per GPU:", "host memory",
                                                                           "note:")))))
    if "refused or replaced:" in lines:
        refused = lines[lines.index("refused or replaced:") + 1:]
        refused = refused[:refused.index("")] if "" in refused else refused
        parts += ["Refused or replaced:", "\n".join(f"- {line.strip()}" for line in refused)]
    if code == 0:
        parts += ["Overrides (last line of the output):", block(lines[-1])]
    return "\n\n".join(parts)


def _longest_cells(model: str, nodes: int, per_node: int, alst: int, reference: bool,
                   host_gib: int | None = None) -> tuple[str, str]:
    """(the table cell, the detail line) of one search: the longest length, its plan, and at ALST's length
    either "fits" or where the memory goes."""
    sys.path.insert(0, str(ROOT))
    from rlsp.plan import cli
    from rlsp.plan.explain import fsdp_name, layout_name, settings_name
    from rlsp.plan.longest import longest_length, plan_at
    from rlsp.plan.search import search

    args = ["--model", model, "--nodes", str(nodes), "--gpus-per-node", str(per_node), "--gpu-memory-gib", "80",
            "--seq-len", str(2 * alst)] + ["--no-reference"] * (not reference) + \
        (["--host-memory-gib", str(host_gib)] if host_gib else [])
    req, _ = cli.build_request(cli.parse_args(args))
    found = longest_length(req, cli.head_split)
    if found is None:
        return "none", "nothing fits"
    length, plan = found
    gib = 2**30
    picked = (f"{layout_name(plan.layout)}, FSDP {fsdp_name(plan.layout)}, {settings_name(plan)}, "
              f"{plan.memory.peak / gib:.1f} GiB per GPU")
    at = plan_at(req, cli.head_split, alst)
    if at is not None:
        where = f"ALST's {alst:,} fits"
    else:
        import dataclasses
        plans = search(dataclasses.replace(req, seq_len=alst), cli.head_split)
        low = min(plans, key=lambda p: p.memory.peak)
        where = f"at ALST's {alst:,}: {_peak_text(low)}"
        rings = [p for p in plans if p.layout.ring > 1]
        if rings and low.layout.ring == 1:
            where += f"; the smallest with ring attention: {_peak_text(min(rings, key=lambda p: p.memory.peak))}"
    return f"{length:,}" + (" (search bound)" if length >= 2 * alst else ""), f"{length:,} tokens: {picked}; {where}"


def _peak_text(plan) -> str:  # noqa: ANN001 (a rlsp.plan.search.Plan, imported lazily)
    from rlsp.plan.explain import layout_name, settings_name

    gib = 2**30
    terms = ", ".join(f"{k} {v / gib:.1f}" for k, v in plan.memory.terms.items() if v >= 0.05 * gib)
    return (f"{plan.memory.peak / gib:.1f} GiB per GPU at the {plan.memory.phase}, {plan.host / gib:,.0f} GiB of "
            f"host memory per node ({layout_name(plan.layout)}, {settings_name(plan)}; GiB: {terms})")


def alst_table(models: str) -> str:
    """The longest-length table of the Llama-3.1-8B shape against ALST's lengths, and one line per cell."""
    model = str(Path(models) / "Llama-3.1-8B-no-position-limit")
    Path(model).mkdir()
    config = {k: v for k, v in SHAPES["Llama-3.1-8B"].items() if k != "max_position_embeddings"}
    (Path(model) / "config.json").write_text(json.dumps(config))
    rows = ["| GPUs (80 GiB) | ALST (published) | rlsp: actor-only | rlsp: GRPO with reference "
            f"| rlsp: actor-only, {BIG_HOST_GIB} GiB host memory per node |", "|---|---|---|---|---|"]
    details = []
    for nodes, per_node, alst in ALST:
        gpus = nodes * per_node
        cells = {ref: _longest_cells(model, nodes, per_node, alst, ref) for ref in (False, True)}
        big = _longest_cells(model, nodes, per_node, alst, False, BIG_HOST_GIB)
        rows.append(f"| {gpus} ({nodes} x {per_node}) | {alst:,} | {cells[False][0]} | {cells[True][0]} | {big[0]} |")
        gpus_text = f"{gpus} GPU" + "s" * (gpus > 1)
        details += [f"- {gpus_text}, actor-only: {cells[False][1]}", f"- {gpus_text}, GRPO with reference: {cells[True][1]}",
                    f"- {gpus_text}, actor-only, {BIG_HOST_GIB} GiB host memory per node: {big[1]}"]
    return "\n\n".join([ALST_TITLE, ALST_INTRO, "\n".join(rows), "\n".join(details)])


def render() -> str:
    """docs/plan.md with its last section generated from the planner's current output."""
    head, found, section = DOC.read_text().partition(HEADING)
    if not found or "\n## " in section:
        sys.exit(f"{DOC}: expected {HEADING.strip()!r} as the last section")
    intro = section.split("\n| model |")[0].strip()
    columns = re.search(r"^Columns:.*?(?=\n\n)", section, re.M | re.S).group(0)
    with tempfile.TemporaryDirectory() as models:
        for name, config in SHAPES.items():
            (Path(models) / name).mkdir()
            (Path(models) / name / "config.json").write_text(json.dumps(config))
        results = [(args, *run(models, args)) for args in COMMANDS]
        longest = alst_table(models)
    table = "\n".join([TABLE_HEAD, *(table_row(args, code, out) for args, code, out, _ in results)])
    full_out = next(out for args, _, out, _ in results if args == FULL)
    full = block(f"$ python -m rlsp.plan {FULL}", *full_out.splitlines())
    parts = [HEADING.strip(), intro, table, longest, FULL_TITLE, full, columns, *(subsection(*r) for r in results)]
    return head + "\n\n".join(parts) + "\n"


def main() -> None:
    DOC.write_text(render())
    print(f"rewrote {DOC.relative_to(ROOT)}: {len(COMMANDS)} plans")


if __name__ == "__main__":
    main()
