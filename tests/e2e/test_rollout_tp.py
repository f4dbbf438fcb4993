"""Rollout tensor parallelism on CPU: a vLLM engine split over 2 processes (external_launcher, gloo)
generates what one process does after the same weight sync, while each rank holds half the weights.

Two tiny models with large random weights (so greedy decoding is not one repeated token): the engines
are built from one and synced to the other through `update_weights` with full HF tensors, as the
policy worker's weight sync does. Checked: greedy tokens equal tp=1 exactly, their logprobs within
`logprob_tol` of tests/tolerances.py (two kernels of one fp32 model: split matmuls and a vocabulary split
over ranks), and every rank's embedding holds vocab/2 rows.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from tolerances import logprob_tol, scalar_tol
from transformers import AutoConfig

from rlsp.models.tiny import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.e2e

MAX_MODEL_LEN = 128  # the worker's engines': the longest sequence, an upper bound on its token reductions
WORKER = os.path.join(os.path.dirname(__file__), "_rollout_tp_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_engine(world: int, tp: int, model: str, sync_from: str, out_dir) -> list[dict]:
    port, env = _free_port(), {**os.environ, "PYTHONPATH": ROOT, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                               "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    outs = [str(out_dir / f"w{world}_tp{tp}_r{r}.json") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, WORKER, str(r), str(world), str(tp), str(port), model, sync_from, outs[r]],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    errors = [p.communicate(timeout=600)[1] for p in procs]
    for p, err in zip(procs, errors):
        assert p.returncode == 0, err[-3000:]
    return [json.load(open(o)) for o in outs]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("models")
    return (build_tiny_model(TinyModelSpec(init_std=0.3, seed=3), str(root / "start")),
            build_tiny_model(TinyModelSpec(init_std=0.3, seed=4), str(root / "synced")))


def test_tp2_engine_generates_what_one_process_does_with_half_the_weights(models, tmp_path):
    start, synced = models
    (ref,) = _run_engine(1, 1, start, synced, tmp_path)
    ranks = _run_engine(2, 2, start, synced, tmp_path)
    vocab = ref["shapes"]["model.embed_tokens.weight"][0]
    assert len({ids[0] for ids in ref["ids"]}) > 1  # distinct first tokens: a meaningful greedy comparison
    scale = max(abs(a) for la in ref["logprobs"] for a in la)  # large random weights: logprobs beyond log(vocab)
    tol = logprob_tol(AutoConfig.from_pretrained(synced), MAX_MODEL_LEN, value_scale=scale)
    for r in ranks:
        assert r["ids"] == ref["ids"]
        worst = max(abs(a - b) for la, lb in zip(r["logprobs"], ref["logprobs"]) for a, b in zip(la, lb))
        assert worst <= tol, (worst, tol)
        assert r["shapes"]["model.embed_tokens.weight"] == [vocab // 2, ref["shapes"]["model.embed_tokens.weight"][1]]
        assert r["shapes"]["model.layers.0.self_attn.qkv_proj.bias"][0] * 2 == \
            ref["shapes"]["model.layers.0.self_attn.qkv_proj.bias"][0]


def _two_steps(tmp_path, name: str, *overrides: str) -> tuple[list[dict], str]:
    from test_grpo_e2e import _main

    run = tmp_path / name
    run.mkdir()
    proc = _main(run, "trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
                 "trainer.save_final_model=false", "actor_rollout_ref.actor.ppo_mini_batch_size=4", *overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(x) for x in (run / "run" / "metrics.jsonl").read_text().splitlines()], proc.stderr


def test_grpo_with_a_tp2_rollout_engine_matches_one_engine_per_worker(tmp_path):
    """Through the CLI on 2 workers (vllm): one engine over both (tp=2) samples what two engines (tp=1)
    do, so the first step's rewards are equal and its losses equal to fp32 precision; after the update
    the weight sync reaches both halves (the second step's sampled tokens match the trainer's logprobs:
    vLLM's kernel against the trainer's, `logprob_tol` of the run's model)."""
    from test_sequence_layouts_e2e import CLOSE, assert_same_step, run_tolerances

    plain, _ = _two_steps(tmp_path, "tp1")
    split, log = _two_steps(tmp_path, "tp2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    assert "rollout tp=2" in log
    assert_same_step(split[0], plain[0], CLOSE, tmp_path / "tp1" / "run")
    metric_rtol, _, scale = run_tolerances(tmp_path / "tp1" / "run")
    tol = scalar_tol(scale, metric_rtol)
    assert split[1]["rollout/logprob_diff"] <= tol and plain[1]["rollout/logprob_diff"] <= tol, (split[1], plain[1], tol)
