"""docs/config.md lists exactly the schema's keys and defaults (it is generated from the schema)."""

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_config_doc_is_current():
    gen = runpy.run_path(str(ROOT / "scripts" / "gen_config_doc.py"))
    assert (ROOT / "docs" / "config.md").read_text() == gen["render"](), "run: python scripts/gen_config_doc.py"
