"""Regenerate the "## Plans for public model shapes" section of docs/plan.md from the current planner.

Writes a config.json for each of four public model shapes (Qwen2.5-0.5B, Qwen2.5-7B, Qwen2.5-14B,
Llama-3-70B: tests/data/public_model_shapes.json) into a temporary directory, runs the section's
`python -m rlsp.plan` commands there and rewrites the summary table, the full-output block and the
per-command subsections from what they print. The section's prose (the paragraph under its heading and
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
    "--model Qwen2.5-0.5B --nodes 1 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 131072 --overrides",
    "--model Qwen2.5-0.5B --nodes 1 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 1048576 --overrides",
    "--model Qwen2.5-7B --nodes 1 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 32768 --overrides",
    "--model Qwen2.5-7B --nodes 1 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 32768 --algo ppo --overrides",
    "--model Qwen2.5-7B --nodes 2 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 131072 --overrides",
    "--model Qwen2.5-7B --nodes 8 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 1048576 --overrides",
    "--model Qwen2.5-14B --nodes 1 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 32768 --overrides",
    "--model Qwen2.5-14B --nodes 2 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 32768 --overrides",
    "--model Qwen2.5-14B --nodes 2 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 1048576 --overrides",
    "--model Qwen2.5-14B --nodes 8 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 131072 --overrides",
    "--model Llama-3-70B --nodes 1 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 32768 --overrides",
    "--model Llama-3-70B --nodes 8 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 32768 --overrides",
    "--model Llama-3-70B --nodes 8 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 131072 --overrides",
    "--model Llama-3-70B --nodes 8 --gpus-per-node 8 --gpu-memory-gib 80 --seq-len 1048576 --overrides",
    "--model Llama-3-70B --nodes 1 --gpus-per-node 8 --gpu-memory-gib 24 --seq-len 1048576 --overrides",
]
FULL_TITLE = "### Full output: Qwen2.5-7B, 32k tokens, 8 GPUs of 80 GiB"
FULL = COMMANDS[3]  # shown whole: Qwen2.5-7B, 32k, 1 x 8
TABLE_HEAD = ("| model | sequence | nodes x GPUs | algo | recommended | tokens/GPU | GiB/GPU | est. tokens/s/GPU |\n"
              "|---|---|---|---|---|---|---|---|")
SEQ = {"32768": "32k", "131072": "128k", "1048576": "1M"}
ROLLOUT_NOTE = " (training only: the rollout holds the whole model)"


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
    return opt["--model"], SEQ[opt["--seq-len"]], cluster, opt.get("--algo", "grpo").upper()


def table_row(args: str, code: int, out: str) -> str:
    model, seq, cluster, algo = describe(args)
    nodes, _, gib = cluster.partition(" GPUs of ")
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
    parts = [f"### {model}, {seq} tokens, {cluster}" + (" (PPO)" if algo == "PPO" else ""),
             block(f"python -m rlsp.plan {args}")]
    if code == 2:
        parts += ["Exit code 2:", block(err.strip())]
    else:
        parts.append(block(*(line for line in lines if line.startswith(("recommended:", "memory per GPU:", "note:")))))
    if "refused or replaced:" in lines:
        refused = lines[lines.index("refused or replaced:") + 1:]
        refused = refused[:refused.index("")] if "" in refused else refused
        parts += ["Refused or replaced:", "\n".join(f"- {line.strip()}" for line in refused)]
    if code == 0:
        parts += ["Overrides (last line of the output):", block(lines[-1])]
    return "\n\n".join(parts)


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
    table = "\n".join([TABLE_HEAD, *(table_row(args, code, out) for args, code, out, _ in results)])
    full_out = next(out for args, _, out, _ in results if args == FULL)
    full = block(f"$ python -m rlsp.plan {FULL}", *full_out.splitlines())
    parts = [HEADING.strip(), intro, table, FULL_TITLE, full, columns, *(subsection(*r) for r in results)]
    return head + "\n\n".join(parts) + "\n"


def main() -> None:
    DOC.write_text(render())
    print(f"rewrote {DOC.relative_to(ROOT)}: {len(COMMANDS)} plans")


if __name__ == "__main__":
    main()
