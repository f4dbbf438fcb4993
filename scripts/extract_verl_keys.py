"""Write rlsp/config/verl_0_9_keys.json: every key of a verl release's trainer config with verl's default value.

`python scripts/extract_verl_keys.py <verl git dir> [<tag>]` (default tag v0.9.0) reads, at that tag,
verl/trainer/config/_generated_ppo_trainer.yaml: verl's PPO trainer config with every default filled in (the
FSDP engine's blocks `engine/fsdp.yaml` and `optim/fsdp.yaml` included, as `*.fsdp_config.*` / `critic.fsdp.*`
and `*.optim.*`). Each leaf becomes one dotted key -> verl's default as written there (interpolations such as
`${oc.select:...}` stay text; an empty mapping or a list is one value; `_target_` entries, which name verl's
classes, are left out). The script checks that every key of engine/fsdp.yaml appears under the actor's FSDP
block, so the FSDP engine's whole surface is in the list.

The file is read by rlsp (rlsp.config.verl_keys: verl's default of a refused key, for the "not set" rule) and by
scripts/gen_config_doc.py and tests/unit/test_verl_keys.py (every key gets one answer).
tests/data/verl_0_9_keys.json links to it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "rlsp" / "config" / "verl_0_9_keys.json"
GENERATED = "verl/trainer/config/_generated_ppo_trainer.yaml"
FSDP_ENGINE = "verl/trainer/config/engine/fsdp.yaml"


def _show(git_dir: str, tag: str, path: str) -> str:
    return subprocess.run(["git", "-C", git_dir, "show", f"{tag}:{path}"], check=True, capture_output=True,
                          text=True).stdout


def flatten(node: object, prefix: str = "") -> dict[str, object]:
    """Dotted leaf keys of a YAML mapping -> their values (`_target_` left out; {} and lists are values)."""
    out: dict[str, object] = {}
    if isinstance(node, dict) and node:
        for key, value in node.items():
            if key != "_target_":
                out.update(flatten(value, f"{prefix}{key}."))
    else:
        out[prefix[:-1]] = node
    return out


def extract(git_dir: str, tag: str) -> dict[str, object]:
    keys = flatten(yaml.safe_load(_show(git_dir, tag, GENERATED)))
    engine = flatten(yaml.safe_load(_show(git_dir, tag, FSDP_ENGINE)))
    missing = [k for k in engine if f"actor_rollout_ref.actor.fsdp_config.{k}" not in keys]
    if missing:
        raise SystemExit(f"{FSDP_ENGINE} keys missing from {GENERATED}: {missing}")
    commit = subprocess.run(["git", "-C", git_dir, "rev-parse", f"{tag}^{{commit}}"], check=True, capture_output=True,
                            text=True).stdout.strip()
    return {"source": {"repository": "verl-project/verl", "tag": tag, "commit": commit, "file": GENERATED,
                       "note": "every leaf key of verl's generated PPO trainer config (FSDP engine) -> verl's default"},
            "keys": keys}


def main(argv: list[str]) -> None:
    data = extract(argv[0], argv[1] if len(argv) > 1 else "v0.9.0")
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{len(data['keys'])} keys -> {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main(sys.argv[1:])
