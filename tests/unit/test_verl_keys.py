"""verl 0.9's whole key surface (rlsp/config/verl_0_9_keys.json, written by scripts/extract_verl_keys.py): every
key gets exactly one answer computed from rlsp's own tables (rlsp.config.verl_keys.answer), "not set" is accepted
for every refused key, and docs/config.md's "Coming from verl" section is generated from the list."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from rlsp.config.compose import drop_not_set
from rlsp.config.validate_keys import schema_keys
from rlsp.config.verl_compat import refusal
from rlsp.config.verl_keys import ACCEPTED_VALUES, VERL_RELEASE, answer, not_set, verl_keys
from rlsp.config.verl_spellings import rlsp_key

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def answers() -> dict[str, tuple[str, str]]:
    declared = set(schema_keys())
    return {key: answer(key, declared) for key in verl_keys()}


def test_every_verl_0_9_key_gets_exactly_one_answer(answers):
    assert len(answers) > 700  # the whole generated trainer config, FSDP engine blocks included
    unanswered = sorted(k for k, (kind, _) in answers.items() if kind not in ("same", "rlsp", "refused"))
    assert unanswered == [], unanswered
    declared = set(schema_keys())
    for key, (kind, text) in answers.items():
        assert text, key
        target = rlsp_key(key)
        if kind == "refused":  # refused by name, with the reason, where rlsp.check and rlsp.main screen overrides
            assert target not in declared and refusal(target), key
        else:
            assert refusal(target) is None or target in declared or key.startswith("distillation.teacher_models.") \
                or any(__import__("fnmatch").fnmatchcase(target, p) for p in ACCEPTED_VALUES), key


def test_not_set_is_accepted_for_every_refused_key(answers):
    """null always; verl's own default where it means off (false, 0, empty, "disabled")."""
    refused = [k for k, (kind, _) in answers.items() if kind == "refused"]
    overrides = [f"{rlsp_key(k)}=null" for k in refused]
    kept, notes = drop_not_set(overrides)
    assert kept == [] and len(notes) == len(refused)
    off = {k: v for k, v in verl_keys().items() if k in refused and v in (False, 0, "disabled") and v is not None}
    assert off  # e.g. transfer_queue.enable=false
    for key, value in off.items():
        assert not_set(rlsp_key(key), value, key), key
    kept, _ = drop_not_set(["algorithm.use_pf_ppo=false", "transfer_queue.enable=False",
                            "ray_kwargs.ray_init.runtime_env.py_executable=null"])
    assert [k for k in kept if not k.startswith("ray_kwargs.ray_init.runtime_env")] == []
    kept, _ = drop_not_set(["algorithm.use_pf_ppo=true", "actor_rollout_ref.hybrid_engine=false"])
    assert len(kept) == 2  # on: still refused by name


def test_config_doc_names_the_release_and_every_key(answers):
    gen = runpy.run_path(str(ROOT / "scripts" / "gen_config_doc.py"))
    text = gen["render"]()
    assert (ROOT / "docs" / "config.md").read_text() == text, "run: python scripts/gen_config_doc.py"
    assert f"verl {VERL_RELEASE}" in text
    section = text[text.index("## verl " + VERL_RELEASE):]
    rows = section.splitlines()
    for key in answers:  # one row names it: whole, or its section with its name among the section's keys
        parent, _, leaf = key.rpartition(".")
        assert any(f"`{key}`" in r or f"`{parent}.`{{" in r and f"`{leaf}`" in r for r in rows), key
