"""rlsp.check accepts Gemma 2 and Gemma 3 (text) at Ulysses 1 and 2, with the hf and the vllm rollout engine,
and with ring attention and tensor parallelism (both run sliding windows and soft-capping exactly:
tests/distributed/test_ring_window_exact.py, test_tp_window_exact.py). Tiny models: tests/tiny_gemma.py."""

from __future__ import annotations

import pandas as pd
import pytest
from tiny_gemma import FAMILIES, write_tiny_gemma

from rlsp.check import main as check_main


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gemma")
    out = {family: write_tiny_gemma(family, str(root / family)) for family in FAMILIES}
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
@pytest.mark.parametrize("ulysses", [1, 2])
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_check_accepts_gemma_at_ulysses_1_and_2(tmp_path, gemma_dirs, family, ulysses, engine, capsys):
    rc, out = _check(tmp_path, gemma_dirs, family, f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={ulysses}",
                     f"actor_rollout_ref.ref.ulysses_sequence_parallel_size={ulysses}",
                     f"actor_rollout_ref.rollout.name={engine}", capsys=capsys)
    # vllm: the tiny models' head_dim 8 has no vLLM CPU kernel (a head-size refusal, not a family one)
    problems = [line for line in out.splitlines() if line.startswith("  - ")]
    assert all("head_dim=8" in p for p in problems), out
    assert (rc == 0) == (engine == "hf"), out


@pytest.mark.parametrize("family", FAMILIES)
def test_check_accepts_ring_and_tp(tmp_path, gemma_dirs, family, capsys):
    rc, out = _check(tmp_path, gemma_dirs, family, "actor_rollout_ref.actor.ring_sequence_parallel_size=2",
                     "actor_rollout_ref.rollout.name=hf", capsys=capsys)
    assert rc == 0 and "ring_sequence_parallel_size" not in out.split("OK")[0], out  # ring runs windows and caps
    rc, out = _check(tmp_path, gemma_dirs, family, "actor_rollout_ref.actor.tensor_model_parallel_size=2",
                     "actor_rollout_ref.rollout.name=hf", capsys=capsys)
    assert rc == 0 and "tensor_model_parallel_size" not in out.split("OK")[0], out  # tp runs them per head
