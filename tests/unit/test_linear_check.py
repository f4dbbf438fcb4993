"""rlsp.check accepts Qwen3-Next and Qwen3.5 (text) with Gated DeltaNet (linear_attention) layers at Ulysses 2 and at
tensor parallelism 2 with the hf rollout engine, and refuses by name what rlsp does not run for them: ring attention
(linear_attention layers) and the vllm rollout engine on cpu (pointing to rollout.name=hf). Tiny models:
tests/tiny_linear.py."""

from __future__ import annotations

import pandas as pd
import pytest
from tiny_linear import FAMILIES, write_tiny_linear

from rlsp.check import main as check_main


@pytest.fixture(scope="module")
def linear_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("linear")
    out = {family: write_tiny_linear(family, str(root / family)) for family in FAMILIES}
    rows = [{"data_source": "rlsp/arithmetic", "prompt": [{"role": "user", "content": "1+1"}],
             "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": i}} for i in range(4)]
    out["train"] = str(root / "train.parquet")
    pd.DataFrame(rows).to_parquet(out["train"])
    return out


def _check(tmp_path, dirs, family: str, *overrides: str, capsys) -> tuple[int, str]:
    rc = check_main(["trainer.device=cpu", f"trainer.cache_dir={tmp_path / 'cache'}",
                     f"trainer.default_local_dir={tmp_path / 'run'}", f"data.train_files={dirs['train']}",
                     "data.val_files=null", "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                     "trainer.total_training_steps=2", "trainer.n_gpus_per_node=2",
                     f"actor_rollout_ref.model.path={dirs[family]}", *overrides])
    return rc, capsys.readouterr().out


@pytest.mark.parametrize("family", FAMILIES)
def test_check_accepts_linear_attention_at_ulysses_2_and_tp_2_and_refuses_the_rest_by_name(tmp_path, linear_dirs, family,
                                                                                   capsys):
    rc, out = _check(tmp_path, linear_dirs, family, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                     "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2", "actor_rollout_ref.rollout.name=hf",
                     capsys=capsys)
    assert rc == 0, out
    rc, out = _check(tmp_path, linear_dirs, family, "actor_rollout_ref.actor.ring_sequence_parallel_size=2",
                     "actor_rollout_ref.rollout.name=hf", capsys=capsys)
    assert rc == 2 and f"ring_sequence_parallel_size=2: {family} has linear_attention" in out, out
    rc, out = _check(tmp_path, linear_dirs, family, "actor_rollout_ref.actor.tensor_model_parallel_size=2",
                     "actor_rollout_ref.rollout.name=hf", capsys=capsys)
    assert rc == 0, out  # split by key-head groups (rlsp.parallel.tp_linear_attention)
    rc, out = _check(tmp_path, linear_dirs, family, "actor_rollout_ref.rollout.name=vllm", capsys=capsys)
    assert rc == 2 and f"rollout.name=vllm cannot serve {family} on cpu" in out, out
    assert "actor_rollout_ref.rollout.name=hf" in out, out
