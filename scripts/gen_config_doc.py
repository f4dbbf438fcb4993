"""Regenerate docs/config.md from the schema: `python scripts/gen_config_doc.py [--check]`."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import sys
from pathlib import Path

from rlsp.config.choices import REFUSED_VALUES
from rlsp.config.schema import RLSPConfig
from rlsp.config.validate_keys import schema_keys
from rlsp.config.verl_compat import ALIASES, verl_status
from rlsp.config.verl_keys import VERL_RELEASE, answer, verl_keys
from rlsp.config.verl_spellings import PREFIX_RENAMES, RENAMES

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "config.md"
VERL_COMMANDS = ROOT / "tests" / "data" / "verl_commands.json"
VERL_SOURCE = "verl/trainer/config/_generated_ppo_trainer.yaml"
VERL_COMMANDS_2026 = ROOT / "tests" / "data" / "verl_commands_2026.json"
# What tests/unit/test_verl_commands_2026.py pins (its REFUSED table): the refused scripts and why.
VERL_2026_RESULT = """12 of the 16 are accepted. Refused: one DAPO script's
`model.override_config.max_position_embeddings` (by name), the two rollout-correction
scripts (verl's default `rollout.n=1` with a group estimator), and the SAPO script (`val_kwargs` sampling settings with `do_sample=false`, `algorithm.lam` with grpo:
settings that would have no effect)."""
VERL_HEADER = """
## Coming from verl

rlsp tracks verl's release v0.9.0 (verl-project/verl): every key of it is answered below ("verl v0.9.0, key by
key").

verl's command lines run unchanged: `python -m rlsp.main --config-name verl <the arguments of
verl.trainer.main_ppo>`. `configs/verl.yaml` holds verl's defaults where rlsp's differ (one sample per
prompt, no KL loss, weight decay 0.01, GAE, gradient checkpointing, no prompt filtering, checkpoints
under `checkpoints/<project>/<experiment>`); the default config (`rlsp`) is the tiny CPU demo's. Check
a command first, without Ray or a GPU, for the cluster it names:

    python -m rlsp.check --config-name verl <the same arguments>

It lists every problem at once (exit 2; 0 when there is none) and prints where each role runs with
which degrees, how a step's batch is split, the token budgets, the run length and what rlsp does with
each verl key that it handles its own way.

Rules taken from verl: the run is `trainer.total_epochs` x batches per epoch unless
`trainer.total_training_steps` is set; unset log-prob token budgets of the reference and the rollout
follow the actor's (`use_dynamic_bsz`, `ppo_max_token_len_per_gpu`), and so do the critic's
mini-batch, epochs, shuffle and dynamic batching; `trainer.logger` is one name or a list;
`critic.loss_agg_mode` is the actor's unless set. Every `loss_agg_mode` (token-mean, seq-mean-token-sum,
seq-mean-token-mean, seq-mean-token-sum-norm with `loss_scale_factor`, default the response length)
applies to the policy, KL and entropy terms alike, and is exact over the whole mini-batch (verl's
seq-mean-token-sum-norm scales with the micro-batch size; rlsp's is the mean over the mini-batch's
sequences). `model.use_remove_padding=false` (verl's padded forward) has no effect: rlsp packs sequences
either way and computes the same logprobs and values (refused with Ulysses sp > 1, as in verl). With
LoRA, `ref.fsdp_config.param_offload` / `offload_policy` have no effect: the reference is the actor's
engine with the adapters off (as in verl), whose base weights `actor.fsdp_config.*` offloads. rlsp
logs each such no-effect setting once at start-up.
"""
HEADER = """# Configuration

Every key below can be overridden on the command line (`python -m rlsp.main key=value ...`). Names
follow verl where a verl user would expect them. The schema is `rlsp/config/schema.py` (this page is
generated from it by `scripts/gen_config_doc.py`); `configs/grpo.yaml` uses them as they are, and
`configs/rlsp.yaml` (the default config) overrides a few for
the tiny CPU demo. Values are checked at start-up (`rlsp/config/validate.py`,
`rlsp/checks/preflight.py`) before any worker has the run's config. A default of `auto` (FSDP sharding, token-budget
micro-batches, gradient checkpointing, the rollout engine) is decided at start-up from the model's
config.json and the machine (`rlsp/config/auto.py`); each decision is printed with its reason, and
`python -m rlsp.check` shows them for a command without running it.

Batch-size semantics (as in verl): `data.train_batch_size` and `actor_rollout_ref.actor.ppo_mini_batch_size`
count *prompts*; each yields `rollout.n` samples. `*_micro_batch_size_per_gpu` counts *samples* per
worker per forward. Generation splits prompts over all workers; training splits samples over the
dp = workers / sp groups, and every rank of an sp group gets the same rows.

`builtin://tiny-qwen2`, `builtin://tiny-qwen2.5-vl` (a tiny vision-language model) and `builtin://arithmetic/{train,test}` are built locally under
`trainer.cache_dir` on first use; any other value is a local path.

| key | default | notes |
|---|---|---|
"""


def _comments(cls: type) -> dict[str, str]:
    """Trailing comments of the field lines of `cls` and its dataclass bases (the class's own win)."""
    found: dict[str, str] = {}
    for klass in cls.__mro__:
        if not dataclasses.is_dataclass(klass):
            continue
        for m in re.finditer(r"^\s+(\w+): [^=\n]+= [^\n#]*?(?:#\s*(.*))?$", inspect.getsource(klass), re.M):
            if m.group(2):
                found.setdefault(m.group(1), m.group(2).replace("|", "\\|"))
    return found


def _rows(cls: type, prefix: str) -> list[str]:
    rows = []
    notes = _comments(cls)
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(default):
            rows += _rows(type(default), f"{prefix}{f.name}.")
        else:
            rows.append(f"| `{prefix}{f.name}` | `{default!r}` | {notes.get(f.name, '')} |")
    return rows


def _verl_keys(path: Path = VERL_COMMANDS) -> tuple[dict[str, int], dict[str, object]]:
    """(key -> number of verl example scripts using it, the data file's source note)."""
    data = json.loads(path.read_text())
    counts: dict[str, int] = {}
    for command in data["commands"]:
        for key in {a.lstrip("+").partition("=")[0] for a in command["args"]}:
            counts[key] = counts.get(key, 0) + 1
    return counts, data["source"]


def render_verl() -> str:
    """The "Coming from verl" section: rules, refused values, spellings and every key of verl's examples."""
    counts, source = _verl_keys()
    declared = set(schema_keys())
    values = "\n".join(f"- `{key}={value}`: {why}" for (key, value), why in REFUSED_VALUES.items())
    aliases = "\n".join(f"- `{verl}` is `{ours}`" for verl, ours in ALIASES.items())
    status = {key: verl_status(key, declared).replace("|", "\\|") for key in counts}
    rows = "\n".join(f"| `{key}` | {n} | {status[key]} |" for key, n in sorted(counts.items()))
    n_scripts = len(json.loads(VERL_COMMANDS.read_text())["commands"])
    renames = "\n".join([f"- `{verl}*` is `{ours}*`" for verl, ours in PREFIX_RENAMES.items()]
                         + [f"- `{verl}` is `{ours}`" for verl, ours in RENAMES.items()])
    return (VERL_HEADER + f"\nValues refused, with the reason (`key` is the end of the full key):\n\n{values}\n"
            f"\nverl's spellings of rlsp keys, mapped onto them when the config is composed (setting both to "
            f"different values is an error):\n\n{aliases}\n"
            "\nverl's other spellings (one verl release's name for a setting another release, and rlsp, name "
            "differently), rewritten on the command line by rlsp.main and rlsp.check (both spellings with different "
            "values are refused; `reward.reward_model.*` also sets `reward_model.use_reward_loop=true` unless given, "
            f"as newer verl serves reward models through its reward loop only):\n\n{renames}\n"
            f"\nEvery key of verl's example commands: the {n_scripts} scripts of {source['selection']} at verl commit "
            f"`{source['commit'][:12]}`, listed in `tests/data/verl_commands.json` and checked by "
            "`tests/unit/test_verl_commands.py`.\n\n| key | scripts | in rlsp |\n|---|---|---|\n" + rows + "\n"
            + render_verl_2026(declared))


def render_verl_2026(declared: set[str]) -> str:
    """The keys of verl's algorithm-folder examples (tests/data/verl_commands_2026.json) not in the table above."""
    old, _ = _verl_keys()
    counts, source = _verl_keys(VERL_COMMANDS_2026)
    n_scripts = len(json.loads(VERL_COMMANDS_2026.read_text())["commands"])
    new = {k: n for k, n in counts.items() if k not in old}
    status = {k: verl_status(k, declared).replace("|", "\\|") for k in new}
    rows = "\n".join(f"| `{k}` | {n} | {status[k]} |" for k, n in sorted(new.items()))
    return (f"\nverl's algorithm-folder examples: the {n_scripts} scripts of {source['selection']} at verl commit "
            f"`{source['commit'][:12]}` (`tests/data/verl_commands_2026.json`, written by "
            "`scripts/extract_verl_commands.py --2026`), checked by `tests/unit/test_verl_commands_2026.py`. "
            f"{VERL_2026_RESULT}\n\nTheir keys that the table above does not list:\n\n"
            "| key | scripts | in rlsp |\n|---|---|---|\n" + rows + "\n")


_KINDS = {"same": "same", "rlsp": "rlsp's way", "refused": "refused"}


def render_verl_release() -> str:
    """verl 0.9's whole key surface (rlsp/config/verl_0_9_keys.json) with rlsp's answer per key, keys of one
    section with the same answer in one row."""
    declared = set(schema_keys())
    keys = verl_keys()
    groups: dict[tuple[str, str, str], list[str]] = {}
    for key in keys:
        kind, text = answer(key, declared)
        parent, _, leaf = key.rpartition(".")
        groups.setdefault((parent, kind, text), []).append(leaf)
    counts = {k: sum(len(v) for (_, kind, _), v in groups.items() if kind == k) for k in _KINDS}
    rows = []
    for (parent, kind, text), leaves in sorted(groups.items()):
        names = ", ".join(f"`{leaf}`" for leaf in leaves)
        where = f"`{parent}.`{{{names}}}" if len(leaves) > 1 else f"`{parent}.{leaves[0]}`" if parent else names
        rows.append(f"| {where} | {_KINDS[kind]} | {'' if kind == 'same' else text.replace('|', chr(92) + '|')} |")
    return (f"\n## verl {VERL_RELEASE}, key by key\n\nrlsp tracks verl {VERL_RELEASE}: every key of its PPO trainer "
            f"config (`{VERL_SOURCE}`, FSDP engine blocks included; {len(keys)} keys, listed with verl's defaults in "
            "`rlsp/config/verl_0_9_keys.json`, written by `scripts/extract_verl_keys.py`) gets one answer, computed "
            "from rlsp's tables (`rlsp/config/verl_keys.py`): **same** (declared with verl's meaning, or verl's other "
            f"spelling of a declared key): {counts['same']}; **rlsp's way** (accepted; the note says how): "
            f"{counts['rlsp']}; **refused** by name with the reason: {counts['refused']}. A refused key set to verl's "
            "\"not set\" (null, or verl's own default where it means off: false, 0, empty, `disabled`) is accepted "
            "and left out with a note. `tests/unit/test_verl_keys.py` checks every key has one answer.\n\n"
            "| verl keys | in rlsp | how / why |\n|---|---|---|\n" + "\n".join(rows) + "\n")


def render() -> str:
    return HEADER + "\n".join(_rows(RLSPConfig, "")) + "\n" + render_verl() + render_verl_release()


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if DOC.read_text() == text else "docs/config.md is stale: run python scripts/gen_config_doc.py")
    DOC.write_text(text)
