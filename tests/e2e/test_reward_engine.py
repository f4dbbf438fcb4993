"""The reward loop's engine (rlsp.rollout.vllm_reward) on CPU: a vLLM pooling engine scores token-id
sequences with the reward model's raw output, next to a vLLM rollout engine in the same process.

Checked: tp=1 scores equal the Hugging Face `*ForSequenceClassification` forward (fp32), and tp=2 over 2
gloo processes (rollout tp=2 beside it) gives every rank the tp=1 scores, within the bound of two fp32
forwards of the reward model (tests/tolerances.py, `model_rtol` at the scores' scale); building the engine leaves the global RNG as it was; the
rollout engine still generates; an input longer than max_model_len is refused naming its length.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import _reward_engine_worker as worker
import pytest
import torch
from test_rollout_tp import ROOT, _free_port
from tolerances import model_rtol, scalar_tol
from transformers import AutoConfig, AutoModelForSequenceClassification

from rlsp.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_reward_model

pytestmark = pytest.mark.e2e


def _run(world: int, tp: int, rm: str, policy: str, out_dir) -> list[dict]:
    port, env = _free_port(), {**os.environ, "PYTHONPATH": ROOT, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                               "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    outs = [str(out_dir / f"rm_w{world}_tp{tp}_r{r}.json") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, worker.__file__, str(r), str(world), str(tp), str(port), rm, policy,
                               str(tp), outs[r]], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    errors = [p.communicate(timeout=600)[1] for p in procs]
    for p, err in zip(procs, errors):
        assert p.returncode == 0, err[-3000:]
    return [json.load(open(o)) for o in outs]


def test_reward_engine_matches_hf_and_tp(tmp_path):
    rm = build_tiny_reward_model(TinyModelSpec(init_std=0.3, seed=5), str(tmp_path / "rm"))
    policy = build_tiny_model(TinyModelSpec(), str(tmp_path / "policy"))
    model = AutoModelForSequenceClassification.from_pretrained(rm, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [model(input_ids=torch.tensor([s])).logits[0, 0].item() for s in worker.SEQUENCES]

    # two kernels of one fp32 forward (derivation 4) over the longest sequence, at the scores' scale
    tol = scalar_tol(max(map(abs, expected)), model_rtol(AutoConfig.from_pretrained(rm),
                                                         max(map(len, worker.SEQUENCES)), backward=False))
    (single,) = _run(1, 1, rm, policy, tmp_path)
    assert max(abs(a - b) for a, b in zip(single["scores"], expected)) <= tol, (single["scores"], expected, tol)
    assert single["rng_kept"] and len(single["generated"][0]) == 4
    assert "reward-model input 0 is 129 tokens, more than the reward engine's max_model_len=128" in single["too_long"]

    for rank in _run(2, 2, rm, policy, tmp_path):
        assert max(abs(a - b) for a, b in zip(rank["scores"], single["scores"])) <= tol, (rank["scores"], tol)
        assert rank["rng_kept"] and rank["generated"] == single["generated"]
