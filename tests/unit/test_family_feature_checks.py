"""rlsp.check refuses, by name and before workers start, the memory features a family does not take
(rlsp/models/feature_support.py): tiled MLP on MoE layers (gpt_oss, deepseek_v3, qwen3_next), lean RMSNorm on
(1 + weight) norms (gemma2, qwen3_next). LoRA is accepted on every family here (on the fused-expert MoE families it
adapts nn.Linear layers only: tests/unit/test_moe_lora.py). What it accepts trains exactly: tests/distributed/test_family_features.py. The engine's own checks refuse the same models after
loading them; their messages name the family too."""

from __future__ import annotations

import pandas as pd
import pytest
from tiny_deepseek import deepseek_config, write_tiny_deepseek
from tiny_gemma import gemma_config, write_tiny_gemma
from tiny_gpt_oss import gpt_oss_config, write_tiny_gpt_oss
from tiny_linear import linear_config, write_tiny_linear
from tiny_moe import MOE_FAMILIES, moe_config

from rlsp.check import main as check_main
from rlsp.models.feature_support import lean_rmsnorm_problem, lora_problem, tiled_mlp_problem
from rlsp.models.lora import LoraSettings, apply_lora
from rlsp.models.tiled_mlp import apply_tiled_mlp

CONFIGS = {"gemma2": lambda: gemma_config("gemma2"), "gpt_oss": gpt_oss_config,
           "deepseek_v3": lambda: deepseek_config("v3"), "qwen3_next": lambda: linear_config("qwen3_next")}
# family: (tiled MLP refused, lean RMSNorm refused, LoRA refused)
REFUSED = {"gemma2": (False, True, False), "gpt_oss": (True, False, False),
           "deepseek_v3": (True, False, False), "qwen3_next": (True, True, False)}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_feature_problems_name_the_family(family):
    config = CONFIGS[family]()
    problems = (tiled_mlp_problem(config), lean_rmsnorm_problem(config), lora_problem(config))
    assert tuple(p is not None for p in problems) == REFUSED[family]
    for problem, key in zip(problems, ("tiled_mlp.enabled=false", "lean_rmsnorm=false", "lora_rank=0")):
        assert problem is None or (family in problem and f"legal: {key}" in problem), problem


def test_engine_tiled_mlp_refusal_names_the_family():
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_config(gpt_oss_config())
    with pytest.raises(ValueError, match=r"^gpt_oss: decoder layer 0: mlp GptOssMLP .*not an MoE block"):
        apply_tiled_mlp(lm.model, 2)


WRITERS = {"gemma2": lambda d: write_tiny_gemma("gemma2", d), "gpt_oss": write_tiny_gpt_oss,
           "deepseek_v3": lambda d: write_tiny_deepseek("v3", d), "qwen3_next": lambda d: write_tiny_linear("qwen3_next", d)}
FEATURE_KEYS = {"tiled": ("actor_rollout_ref.model.tiled_mlp.enabled=true",),
                "lean": ("actor_rollout_ref.model.lean_rmsnorm=true",),
                "lora": ("actor_rollout_ref.model.lora_rank=4",)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    out = {family: write(str(root / family)) for family, write in WRITERS.items()}
    rows = [{"data_source": "rlsp/arithmetic", "prompt": [{"role": "user", "content": "1+1"}],
             "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": i}} for i in range(4)]
    out["train"] = str(root / "train.parquet")
    pd.DataFrame(rows).to_parquet(out["train"])
    return out


def _check(tmp_path, dirs, family: str, overrides: tuple[str, ...], capsys) -> tuple[int, list[str]]:
    rc = check_main(["trainer.device=cpu", f"trainer.cache_dir={tmp_path / 'cache'}",
                     f"trainer.default_local_dir={tmp_path / 'run'}", f"data.train_files={dirs['train']}",
                     "data.val_files=null", "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                     "trainer.total_training_steps=2", "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.name=hf",
                     f"actor_rollout_ref.model.path={dirs[family]}", *overrides])
    return rc, [line for line in capsys.readouterr().out.splitlines() if line.startswith("  - ")]


@pytest.mark.parametrize("family", sorted(WRITERS))
def test_check_refuses_exactly_the_unsupported_features(tmp_path, dirs, family, capsys):
    """One rlsp.check per family with all three features on: one error per refused feature, naming its key."""
    overrides = tuple(o for keys in FEATURE_KEYS.values() for o in keys)
    rc, problems = _check(tmp_path, dirs, family, overrides, capsys)
    expected = [f"actor_rollout_ref.model.{key}" for key, refused in
                zip(("tiled_mlp.enabled=true", "lean_rmsnorm=true", "lora_rank > 0"), REFUSED[family]) if refused]
    assert [any(e in p for p in problems) for e in expected] == [True] * len(expected), problems
    assert len([p for p in problems if family in p and "actor_rollout_ref.model." in p]) == len(expected), problems
    assert rc != 0, problems  # every family here has one refused feature at least


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_check_accepts_the_exact_features(tmp_path, dirs, family, capsys):
    """What tests/distributed/test_family_features.py shows exact passes rlsp.check."""
    accepted = tuple(o for (name, keys), refused in zip(FEATURE_KEYS.items(), REFUSED[family]) if not refused
                     for o in keys)
    rc, problems = _check(tmp_path, dirs, family, accepted, capsys)
    assert rc == 0 and problems == [], problems


def test_critic_sharing_the_model_is_checked_too():
    """A GAE critic starting from the actor's model (critic.model.path unset) takes the same refusals."""
    from omegaconf import OmegaConf

    from rlsp.config.schema import RLSPConfig
    from rlsp.models.feature_support import run_feature_errors

    cfg = OmegaConf.structured(RLSPConfig)
    cfg.critic.model.tiled_mlp.enabled = True
    config = gpt_oss_config()
    assert run_feature_errors(cfg, config) == []  # no critic under the default estimator
    cfg.algorithm.adv_estimator = "gae"
    errors = run_feature_errors(cfg, config)
    assert len(errors) == 1 and errors[0].startswith("critic.model.tiled_mlp.enabled=true: gpt_oss has MoE"), errors


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_lora_precheck_agrees_with_the_engine_on_plain_moe(family):
    """The pre-check refuses LoRA (all-linear) on a plain MoE family exactly when the engine refuses its adapters:
    never (nn.Linear adapters only, no fused expert / router targets); tiled MLP is refused for all of them."""
    from transformers import AutoModelForCausalLM

    config = moe_config(family)
    assert tiled_mlp_problem(config) is not None
    try:
        apply_lora(AutoModelForCausalLM.from_config(config), LoraSettings(rank=4, alpha=8.0))
        engine_refused = False
    except ValueError as exc:
        engine_refused = "ParamWrapper" in str(exc) or "Experts" in str(exc)
    assert (lora_problem(config) is not None) == engine_refused
