"""recipes/grpo_vlm_cpu: its exact command line passes every start-up check of `python -m rlsp.check`.

The recipe's two commands are read from its run.sh as written: the shapes CLI line writes the data (the same
arguments), then the `rlsp.main` line's overrides go through rlsp.check with only `$DATA`, the cache and the run
directory pointed into tmp_path. `builtin://tiny-qwen2.5-vl` is built there by rlsp.models.tiny_vl (the same call
a run makes), so the check reads the real model files: the processor counts each row's image tokens against
data.max_prompt_length, and the layout is the recipe's Ulysses 2; the model's tokenizer, read back as the run reads
it, writes each colour name as one token. Not the training run itself (that is the recipe's README).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from rlsp.check import run_checks
from rlsp.data.tasks import shapes
from rlsp.data.tasks.shapes import COLOURS

RUN_SH = Path(__file__).resolve().parents[2] / "recipes" / "grpo_vlm_cpu" / "run.sh"


def _command(text: str, module: str, data: str) -> list[str]:
    """The arguments after `-m module` on the (continuation-joined) line of run.sh that runs it."""
    line = next(x for x in text.replace("\\\n", " ").splitlines() if f"-m {module}" in x)
    tokens = shlex.split(line.replace('"$DATA"', data).replace("$DATA", data).replace('"$@"', ""))
    return tokens[tokens.index(module) + 1:]


def test_recipe_command_passes_rlsp_check(tmp_path: Path) -> None:
    text = RUN_SH.read_text()
    data = str(tmp_path / "data")
    shapes.main(_command(text, "rlsp.data.tasks.shapes", data))
    overrides = _command(text, "rlsp.main", data)
    assert "actor_rollout_ref.model.path=builtin://tiny-qwen2.5-vl" in overrides
    report = run_checks([*overrides, f"trainer.cache_dir={tmp_path / 'cache'}",
                         f"trainer.default_local_dir={tmp_path / 'run'}"])
    rendered = report.render()
    assert report.problems == [], rendered
    assert "actor dp=1 ulysses=2" in rendered, rendered
    assert "is unknown before it is loaded" not in rendered, rendered  # auto knows the built-in model's shape
    assert "512 rows with images; image tokens per row min/mean/max 16/16.0/16" in rendered, rendered
    model_dir = tmp_path / "cache" / "models" / "tiny-qwen2.5-vl"
    assert (model_dir / "model.safetensors").is_file()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)  # as the run reads it: each colour name is one token
    for colour in COLOURS:
        ids = tokenizer.encode(f"{colour}<|im_end|>")
        assert len(ids) == 2 and tokenizer.decode(ids) == f"{colour}<|im_end|>", (colour, ids)
    assert AutoConfig.from_pretrained(model_dir).text_config.vocab_size == len(tokenizer) == 78
