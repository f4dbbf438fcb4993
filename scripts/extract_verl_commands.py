"""Write tests/data/verl_commands.json (or verl_commands_2026.json): the argument lists of verl's example
training commands.

`python scripts/extract_verl_commands.py <verl checkout> [<commit>]` reads the shell scripts under
examples/grpo_trainer and examples/ppo_trainer of a verl checkout and keeps those that train a text
model with FSDP and vLLM: not Megatron (by name or --config-name), NPU, SGLang or TensorRT-LLM, nor a
vision-language model. For each it records the script's path and the arguments of its
`python3 -m verl.trainer.main_ppo` command, with the script's own shell variables expanded (paths
under $HOME stay as they are: tests/unit/test_verl_commands.py swaps model and data paths for local
ones) and the trailing "$@" dropped.

`python scripts/extract_verl_commands.py --2026 <root> <commit>` writes tests/data/verl_commands_2026.json from
the algorithm folders of a newer verl (DIRS_2026). Those scripts build their commands with shell arithmetic,
string variables holding several overrides and backend switches, which only a shell expands faithfully: each
script runs under bash with an empty PATH (no program runs; every external command is a no-op returning 0)
and `python`/`python3` (also behind `srun` or `ray job submit`) a shell function that records the arguments of the first `-m verl.trainer.main_ppo`
call and stops the script. $HOME stays literal, the cluster size comes from SHELL_ENV, and `--config-path` /
`--config-name` are recorded apart from the overrides.

`python scripts/extract_verl_commands.py --0.9 <root> <tag> <commit>` writes tests/data/verl_commands_0_9.json
from a checkout of verl's release `tag` (v0.9.0): every examples/*/run_*_fsdp*.sh outside sft/, ascend_extras/
and tuning/ whose `verl.trainer.main_ppo` (or `main_ppo_sync`) command trains with FSDP, expanded the same way,
with its rollout engine and the model family (model_type) of the model it names (`family`). A `python3 -c`
probe fails (no module such as torch_npu is installed) and `ulimit` succeeds, as on a GPU cluster.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

DIRS = ("examples/grpo_trainer", "examples/ppo_trainer")
EXCLUDED_NAME = re.compile(r"megatron|npu|sgl|trtllm|_vl|vl-|vl_|glm41v|minicpmo", re.I)
ENTRY = "verl.trainer.main_ppo"
DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data")
OUT = os.path.join(DATA, "verl_commands.json")
OUT_2026 = os.path.join(DATA, "verl_commands_2026.json")
DIRS_2026 = tuple(f"examples/{name}" for name in (
    "cispo_trainer", "gdpo", "gdpo_trainer", "gmpo_trainer", "gpg_trainer", "gspo_trainer", "on_policy_distillation_trainer",
    "otb_trainer", "reinforce_plus_plus_trainer", "remax_trainer", "rloo_trainer", "rollout_correction", "sapo_trainer"))
# Variables the scripts read from a Slurm/cluster environment without a default of their own: one 8-GPU node.
SHELL_ENV = {"SLURM_GPUS_PER_NODE": "8", "SLURM_JOB_NUM_NODES": "1", "GPUS_PER_NODE": "8"}
_SHELL_PRELUDE = r"""
trap '' PIPE  # `python3 ... 2>&1 | tee log`: tee is a no-op that reads nothing; the recorder must not die writing
command_not_found_handle() { return 0; }
_verl_record() {
  if [ "$1" = "-c" ]; then return 1; fi  # a probe (python3 -c 'import torch_npu'): no such module here
  if [ "$1" = "-m" ] && { [ "$2" = "verl.trainer.main_ppo" ] || [ "$2" = "verl.trainer.main_ppo_sync" ]; }; then
    shift 2; printf '%s\0' "$@" > "$VERL_ARGS_OUT"; exit 0
  fi
  return 0
}
python() { _verl_record "$@"; }
python3() { _verl_record "$@"; }
_launch() {  # srun / ray job submit: skip the launcher's own arguments up to the python command
  while [ $# -gt 0 ] && [ "$1" != python ] && [ "$1" != python3 ]; do shift; done
  if [ $# -gt 0 ]; then "$@"; fi
}
ulimit() { return 0; }  # raising the open-files limit (a cluster allows it; this machine may not)
srun() { _launch "$@"; }
ray() { _launch "$@"; }
"""


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


def command_args_bash(script_path: str) -> list[str] | None:
    """The arguments of the script's first `python3 -m verl.trainer.main_ppo` as bash expands them (see the module
    docstring), or None when it has no such command."""
    with tempfile.TemporaryDirectory() as tmp:
        prelude, out, empty = os.path.join(tmp, "prelude.sh"), os.path.join(tmp, "args"), os.path.join(tmp, "bin")
        os.mkdir(empty)
        with open(prelude, "w") as f:
            f.write(_SHELL_PRELUDE)
        env = {"PATH": empty, "HOME": "$HOME", "BASH_ENV": prelude, "VERL_ARGS_OUT": out, **SHELL_ENV}
        subprocess.run(["/bin/bash", os.path.abspath(script_path)], cwd=tmp, env=env, capture_output=True, timeout=60)
        if not os.path.exists(out):
            return None
        with open(out) as f:
            args = [a for a in f.read().split("\0") if a]
    # The working directory (a temporary one) stands for the script's $PWD.
    return [a.replace(os.path.realpath(tmp), "$PWD").replace(tmp, "$PWD") for a in args]


def split_config_flags(args: list[str]) -> tuple[str | None, list[str]]:
    """(the --config-name given, the overrides without --config-path/--config-name)."""
    name, rest, skip = None, [], False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        flag, eq, value = arg.partition("=")
        if flag in ("--config-path", "--config-name", "-cp", "-cn"):
            if not eq:
                value, skip = (args[i + 1] if i + 1 < len(args) else ""), True
            if flag in ("--config-name", "-cn"):
                name = value.removesuffix(".yaml")
            continue
        rest.append(arg)
    return name, rest


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


def extract_2026(root: str, commit: str) -> list[dict[str, object]]:
    found = []
    for folder in DIRS_2026:
        if not os.path.isdir(os.path.join(root, folder)):
            continue
        for name in sorted(os.listdir(os.path.join(root, folder))):
            if not name.endswith(".sh") or EXCLUDED_NAME.search(name):
                continue
            args = command_args_bash(os.path.join(root, folder, name))
            if args is None:
                continue
            config_name, overrides = split_config_flags(args)
            if "megatron" in (config_name or "") or not trains_text_with_fsdp_and_vllm(overrides):
                continue
            found.append({"script": f"{folder}/{name}", "commit": commit, "config_name": config_name or "ppo_trainer",
                          "args": overrides})
    return found


def main_2026(root: str, commit: str) -> None:
    commands = extract_2026(root, commit)
    data = {"source": {"repository": "volcengine/verl", "commit": commit, "environment": SHELL_ENV,
                       "selection": "examples/{cispo,gmpo,gpg,gspo,otb,reinforce_plus_plus,remax,rloo,sapo}_trainer, "
                                    "examples/rollout_correction, examples/gdpo(_trainer) and "
                                    "examples/on_policy_distillation_trainer /*.sh (the newest version stored) that "
                                    "train a text model with FSDP and vLLM (no Megatron, NPU, SGLang, TensorRT-LLM or "
                                    "vision-language scripts), expanded by bash with no program run"},
            "commands": commands}
    with open(OUT_2026, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"{len(commands)} commands -> {OUT_2026}")


OUT_0_9 = os.path.join(DATA, "verl_commands_0_9.json")
SKIPPED_0_9 = ("sft", "ascend_extras", "tuning")
# The script's own default of a variable it reads (under `set -u`) before assigning it.
SHELL_ENV_0_9 = {**SHELL_ENV, "INFER_BACKEND": "vllm"}
# The model family (Hugging Face model_type) a script trains, from its model path: first match wins.
FAMILIES_0_9 = (
    (r"qwen3[._-]?5.*a3b", "qwen3_5_moe"), (r"qwen3[._-]?5", "qwen3_5"), (r"qwen3-next", "qwen3_next"),
    (r"qwen3-vl.*a3b", "qwen3_vl_moe"), (r"qwen3-vl", "qwen3_vl"), (r"qwen2\.5-vl", "qwen2_5_vl"),
    (r"glm-4\.1v", "glm4v"), (r"minicpm-o", "minicpmo"), (r"gpt-oss", "gpt_oss"), (r"seed-oss", "seed_oss"),
    (r"mistral", "mistral"), (r"llama", "llama"), (r"qwen3-.*a3b", "qwen3_moe"), (r"qwen3", "qwen3"),
    (r"qwen2", "qwen2"))


def family(model_path: str) -> str:
    """The model_type of the checkpoint a script's model path names (FAMILIES_0_9)."""
    name = model_path.rstrip("/").rsplit("/", 1)[-1].lower()
    return next(f for pattern, f in FAMILIES_0_9 if re.search(pattern, name))


def extract_0_9(root: str, commit: str) -> list[dict[str, object]]:
    """verl 0.9's FSDP example scripts (examples/*/run_*_fsdp*.sh outside SKIPPED_0_9; main_ppo or main_ppo_sync;
    not --config-name *megatron*), each with its rollout engine and model family."""
    found = []
    SHELL_ENV.update(SHELL_ENV_0_9)
    for folder in sorted(os.listdir(os.path.join(root, "examples"))):
        if folder in SKIPPED_0_9 or not os.path.isdir(os.path.join(root, "examples", folder)):
            continue
        for name in sorted(os.listdir(os.path.join(root, "examples", folder))):
            if not re.fullmatch(r"run_.*_fsdp.*\.sh", name):
                continue
            args = command_args_bash(os.path.join(root, "examples", folder, name))
            if args is None:
                continue
            config_name, overrides = split_config_flags(args)
            if "megatron" in (config_name or ""):
                continue
            values = dict(a.lstrip("+").partition("=")[::2] for a in overrides)
            found.append({"script": f"examples/{folder}/{name}", "commit": commit,
                          "config_name": config_name or "ppo_trainer",
                          "rollout": values.get("actor_rollout_ref.rollout.name", "vllm"),
                          "family": family(values["actor_rollout_ref.model.path"]), "args": overrides})
    return found


def main_0_9(root: str, tag: str, commit: str) -> None:
    commands = extract_0_9(root, commit)
    data = {"source": {"repository": "verl-project/verl", "tag": tag, "commit": commit, "environment": SHELL_ENV_0_9,
                       "selection": "examples/*/run_*_fsdp*.sh (not sft/, ascend_extras/, tuning/) whose "
                                    "verl.trainer.main_ppo(_sync) command trains with FSDP (no Megatron config), "
                                    "expanded by bash with no program run; `rollout` is the rollout engine, `family` "
                                    "the model_type of the model the script names"},
            "commands": commands}
    with open(OUT_0_9, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"{len(commands)} commands ({sum(c['rollout'] == 'vllm' for c in commands)} with vLLM) -> {OUT_0_9}")


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--0.9":
        main_0_9(argv[1], argv[2] if len(argv) > 2 else "v0.9.0", argv[3] if len(argv) > 3 else "unknown")
        return
    if argv and argv[0] == "--2026":
        main_2026(argv[1], argv[2] if len(argv) > 2 else "unknown")
        return
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
