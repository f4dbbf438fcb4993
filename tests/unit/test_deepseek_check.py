"""rlsp.check accepts a tiny DeepSeek-V3 (multi-latent attention, MoE; tests/tiny_deepseek.py) at Ulysses 2 with the
hf rollout engine and at ring 2 (the layer report names ring attention with v's own head dim), and refuses by name what
rlsp does not run for it: vLLM on CPU (not verified: rollout.name=hf serves it); tensor parallelism 2 is accepted
(multi-latent attention split by heads, rlsp.parallel.tp_latent)."""

from __future__ import annotations

import pandas as pd
import pytest
from tiny_deepseek import write_tiny_deepseek

from rlsp.check import main as check_main


@pytest.fixture(scope="module")
def deepseek_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("deepseek")
    rows = [{"data_source": "rlsp/arithmetic", "prompt": [{"role": "user", "content": "1+1"}],
             "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": i}} for i in range(4)]
    pd.DataFrame(rows).to_parquet(root / "train.parquet")
    return {"model": write_tiny_deepseek("v3", str(root / "v3")), "train": str(root / "train.parquet")}


def _check(tmp_path, dirs, *overrides: str, capsys) -> tuple[int, str]:
    rc = check_main(["trainer.device=cpu", f"trainer.cache_dir={tmp_path / 'cache'}",
                     f"trainer.default_local_dir={tmp_path / 'run'}", f"data.train_files={dirs['train']}",
                     "data.val_files=null", "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                     "trainer.total_training_steps=2", "trainer.n_gpus_per_node=2",
                     f"actor_rollout_ref.model.path={dirs['model']}", *overrides])
    return rc, capsys.readouterr().out


def test_check_accepts_deepseek_v3_at_ulysses_2_with_hf_rollout(tmp_path, deepseek_dirs, capsys):
    rc, out = _check(tmp_path, deepseek_dirs, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                     "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2", "actor_rollout_ref.rollout.name=hf",
                     capsys=capsys)
    assert rc == 0, out


def test_check_accepts_ring_and_tp_refuses_vllm_cpu_by_name(tmp_path, deepseek_dirs, capsys):
    rc, out = _check(tmp_path, deepseek_dirs, "actor_rollout_ref.actor.ring_sequence_parallel_size=2",
                     "actor_rollout_ref.rollout.name=hf", capsys=capsys)
    assert rc == 0 and "ring attention over 2 ranks" in out and "v dim 6 side by side" in out, out
    rc, out = _check(tmp_path, deepseek_dirs, "actor_rollout_ref.actor.tensor_model_parallel_size=2",
                     "actor_rollout_ref.rollout.name=hf", capsys=capsys)
    assert rc == 0 and "tp 2: 3 q / 3 kv heads per tp rank" in out, out  # heads split (rlsp.parallel.tp_latent)
    rc, out = _check(tmp_path, deepseek_dirs, "actor_rollout_ref.rollout.name=vllm", capsys=capsys)
    assert rc == 2 and "rollout.name=vllm cannot serve deepseek_v3 on cpu: its multi-latent attention" in out, out
