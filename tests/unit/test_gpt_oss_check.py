"""rlsp.check accepts a tiny gpt-oss (tests/tiny_gpt_oss.py) at Ulysses 2 with the hf rollout engine, and
accepts ring attention and tensor parallelism (both run sliding windows and sinks exactly; tp replicates the
experts), and refuses by name the vllm rollout engine on cpu (its in-place weight sync misses the sinks and the
experts)."""

from __future__ import annotations

import pandas as pd
import pytest
from tiny_gpt_oss import write_tiny_gpt_oss

from rlsp.check import main as check_main


@pytest.fixture(scope="module")
def gpt_oss_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gpt_oss")
    rows = [{"data_source": "rlsp/arithmetic", "prompt": [{"role": "user", "content": "1+1"}],
             "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": i}} for i in range(4)]
    pd.DataFrame(rows).to_parquet(root / "train.parquet")
    return {"model": write_tiny_gpt_oss(str(root / "model")), "train": str(root / "train.parquet")}


def _check(tmp_path, dirs, *overrides: str, capsys, engine: str = "hf") -> tuple[int, str]:
    rc = check_main(["trainer.device=cpu", f"trainer.cache_dir={tmp_path / 'cache'}",
                     f"trainer.default_local_dir={tmp_path / 'run'}", f"data.train_files={dirs['train']}",
                     "data.val_files=null", "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                     "trainer.total_training_steps=2", "trainer.n_gpus_per_node=2",
                     f"actor_rollout_ref.model.path={dirs['model']}", f"actor_rollout_ref.rollout.name={engine}", *overrides])
    return rc, capsys.readouterr().out


def test_check_accepts_gpt_oss_at_ulysses_2(tmp_path, gpt_oss_dirs, capsys):
    rc, out = _check(tmp_path, gpt_oss_dirs, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                     "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2", capsys=capsys)
    assert rc == 0, out


def test_check_accepts_ring_and_tp_refuses_vllm_by_name(tmp_path, gpt_oss_dirs, capsys):
    rc, out = _check(tmp_path, gpt_oss_dirs, "trainer.n_gpus_per_node=4", "data.train_batch_size=4",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                     "actor_rollout_ref.actor.ring_sequence_parallel_size=2",
                     "actor_rollout_ref.actor.tensor_model_parallel_size=2", capsys=capsys, engine="vllm")
    assert rc == 2, out
    assert "ring_sequence_parallel_size=2: gpt_oss" not in out, out  # ring runs windows and sinks
    assert "tensor_model_parallel_size=2: gpt_oss" not in out, out  # tp shards the sinks, replicates the experts
    assert "rollout.name=vllm cannot serve gpt_oss on cpu" in out and "rollout.name=hf" in out, out
