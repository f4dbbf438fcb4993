"""Write tests/data/verl_commands.json: the argument lists of verl's example training commands.

`python scripts/extract_verl_commands.py <verl checkout> [<commit>]` reads the shell scripts under
examples/grpo_trainer and examples/ppo_trainer of a verl checkout and keeps those that train a text
model with FSDP and vLLM: not Megatron (by name or --config-name), NPU, SGLang or TensorRT-LLM, nor a
vision-language model. For each it records the script's path and the arguments of its
`python3 -m verl.trainer.main_ppo` command, with the script's own shell variables expanded (paths
under $HOME stay as they are: tests/unit/test_verl_commands.py swaps model and data paths for local
ones) and the trailing "$@" dropped.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys

DIRS = ("examples/grpo_trainer", "examples/ppo_trainer")
EXCLUDED_NAME = re.compile(r"megatron|npu|sgl|trtllm|_vl|vl-|vl_|glm41v|minicpmo", re.I)
ENTRY = "verl.trainer.main_ppo"
OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data", "verl_commands.json")


def _variables(lines: list[str]) -> dict[str, str]:
    """NAME=value assignments of the script (last one wins); ${NAME:-default} keeps the default."""
    out: dict[str, str] = {}
    for line in lines:
        m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", line.strip())
        if m:
            try:
                words = shlex.split(_expand(m.group(2), out), comments=True)
            except ValueError:  # not a plain assignment (a line of an embedded program)
                continue
            out[m.group(1)] = words[0] if words else ""
    return out


def _expand(text: str, env: dict[str, str]) -> str:
    text = re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*):-([^}]*)\}", lambda m: env.get(m.group(1), m.group(2)), text)
    text = re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m.group(1), m.group(0)), text)
    return re.sub(r"\$([A-Za-z_][A-Za-z0-9_]*)", lambda m: env.get(m.group(1), m.group(0)), text)


def command_args(script: str) -> list[str] | None:
    """The arguments after `python3 -m verl.trainer.main_ppo`, or None without such a command."""
    lines = script.splitlines()
    start = next((i for i, line in enumerate(lines) if ENTRY in line), None)
    if start is None:
        return None
    body = []
    for line in lines[start:]:
        line = re.sub(r"\\\s+#.*$", "\\\\", line)  # "key=v \  # comment": keep the continuation
        body.append(line.rstrip())
        if not line.rstrip().endswith("\\"):
            break
    joined = " ".join(x[:-1] if x.endswith("\\") else x for x in body)
    env = _variables(lines[:start])
    tokens = shlex.split(_expand(joined, {k: v for k, v in env.items() if k != "HOME"}))
    args = tokens[tokens.index(ENTRY) + 1:]
    return [a for a in args if a not in ("$@", '"$@"')]


def trains_text_with_fsdp_and_vllm(args: list[str]) -> bool:
    values = dict(a.partition("=")[::2] for a in args if "=" in a)
    if any(a.startswith("--config-name") and "megatron" in a for a in args):
        return False
    return values.get("actor_rollout_ref.rollout.name") == "vllm" and values.get("actor_rollout_ref.actor.strategy",
                                                                                   "fsdp").startswith("fsdp")


def extract(root: str) -> list[dict[str, object]]:
    found = []
    for folder in DIRS:
        for name in sorted(os.listdir(os.path.join(root, folder))):
            if not name.endswith(".sh") or EXCLUDED_NAME.search(name):
                continue
            with open(os.path.join(root, folder, name)) as f:
                args = command_args(f.read())
            if args is not None and trains_text_with_fsdp_and_vllm(args):
                found.append({"script": f"{folder}/{name}", "args": args})
    return found


def main(argv: list[str]) -> None:
    root, commit = argv[0], (argv[1] if len(argv) > 1 else "unknown")
    commands = extract(root)
    data = {"source": {"repository": "volcengine/verl", "commit": commit,
                       "selection": "examples/{grpo,ppo}_trainer/*.sh that train a text model with FSDP and vLLM "
                                    "(no Megatron, NPU, SGLang, TensorRT-LLM or vision-language scripts)"},
            "commands": commands}
    with open(OUT, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"{len(commands)} commands -> {OUT}")


if __name__ == "__main__":
    main(sys.argv[1:])
