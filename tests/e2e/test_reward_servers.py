"""The reward loop's engines in processes of their own (rlsp.controller.reward_servers): what a reward
engine beside a rollout engine of another tensor-parallel degree runs on.

Two servers on the bundles of a 2-worker CPU pool score 5 rollout rows (chunks of 3 and 2) of a tiny
random reward model with a chat template of its own: each row is re-rendered as the reward loop
renders it, and its score, on the row's last response token, equals the Hugging Face fp32 forward of
that rendering within tests/tolerances.py's bound for two fp32 forwards of the reward model at the
scores' scale (zeros elsewhere, exactly). A killed server is named.
"""

from __future__ import annotations

import pytest
import ray
import torch
from omegaconf import OmegaConf
from test_reward_model_e2e import RM_TEMPLATE
from tolerances import model_rtol, scalar_tol
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from rlsp.config.schema import RLSPConfig
from rlsp.controller.reads import read_columns
from rlsp.controller.resource_pool import ResourcePool
from rlsp.controller.reward_servers import RewardServers
from rlsp.controller.worker_group import WorkerDiedError
from rlsp.data.batch import Batch
from rlsp.data.rm_inputs import render_for_reward_model
from rlsp.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_reward_model
from rlsp.workers.columns import assemble

pytestmark = pytest.mark.e2e

P, R = 6, 5  # prompt width (left-padded), response width
RESPONSES = ["12", "7", "345", "", "9981"]


class BlockReader:
    """Reads rows on the driver from the blocks themselves (the whole blocks come here): no worker group in
    this test to build them."""

    def read_rows(self, spec, *refs) -> Batch:
        return assemble(spec, ray.get(list(refs)))


def _rows(tok) -> Batch:
    rows, resp_mask, messages = [], [], []
    for i, text in enumerate(RESPONSES):
        prompt = tok.encode(f"{i}+{i}=", add_special_tokens=False)[-P:]
        response = tok.encode(text, add_special_tokens=False)[:R]
        rows.append([0] * (P - len(prompt)) + prompt + response + [0] * (R - len(response)))
        resp_mask.append([1.0] * len(response) + [0.0] * (R - len(response)))
        messages.append([{"role": "user", "content": f"{i}+{i}="}])
    ids = torch.tensor(rows)
    attention = torch.tensor([[float(x != 0) for x in r[:P]] + m for r, m in zip(rows, resp_mask)])
    return Batch.from_dict({"input_ids": ids, "attention_mask": attention, "response_mask": torch.tensor(resp_mask)},
                           meta={"messages": messages})


def _config(policy: str, rm: str) -> dict:
    cfg = OmegaConf.structured(RLSPConfig)
    for key, val in {"actor_rollout_ref.model.path": policy, "data.max_prompt_length": P, "reward_model.enable": True,
                     "reward_model.use_reward_loop": True, "reward_model.model.path": rm,
                     "reward_model.rollout.dtype": "float32", "reward_model.rollout.max_model_len": 128}.items():
        OmegaConf.update(cfg, key, val)
    return OmegaConf.to_container(cfg, resolve=True)


def test_reward_servers_score_like_the_model(tmp_path):
    policy = build_tiny_model(TinyModelSpec(), str(tmp_path / "policy"))
    rm = build_tiny_reward_model(TinyModelSpec(init_std=0.3, seed=5), str(tmp_path / "rm"), chat_template=RM_TEMPLATE)
    policy_tok, rm_tok = AutoTokenizer.from_pretrained(policy), AutoTokenizer.from_pretrained(rm)
    batch = _rows(policy_tok)
    rendered = render_for_reward_model(batch, P, policy_tok, rm_tok, 128, engine_specials=True)
    model = AutoModelForSequenceClassification.from_pretrained(rm, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [model(input_ids=rendered["input_ids"][b:b + 1, :n]).logits[0, 0].item()
                    for b, n in enumerate(rendered["attention_mask"].sum(-1).tolist())]

    # two kernels of one fp32 forward (vLLM's pooling engine against HF's) over at most max_model_len tokens
    tol = scalar_tol(max(map(abs, expected)), model_rtol(AutoConfig.from_pretrained(rm), 128, backward=False))

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    pool = ResourcePool(1, 2, "cpu", 1, name="policy")
    try:
        pool.create()
        envs = [{"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
                 "VLLM_CPU_OMP_THREADS_BIND": str(rank), "VLLM_LOGGING_LEVEL": "ERROR"} for rank in range(2)]
        servers = RewardServers(pool, _config(policy, rm), envs)
        got = read_columns(BlockReader(), servers.compute_rm_score(batch), ["rm_scores"])["rm_scores"]
        lengths = batch["response_mask"].sum(-1).long()
        for b, score in enumerate(expected):
            if lengths[b] == 0:  # an empty response carries no score
                assert torch.equal(got[b], torch.zeros(R))
                continue
            assert abs(got[b, lengths[b] - 1].item() - score) <= tol, (b, got[b], score, tol)
            assert torch.equal(got[b, :lengths[b] - 1], torch.zeros(int(lengths[b]) - 1))
            assert torch.equal(got[b, lengths[b]:], torch.zeros(R - int(lengths[b])))
        ray.kill(servers.servers[1])
        with pytest.raises(WorkerDiedError, match="reward engine process 1 of 2 died"):
            servers.compute_rm_score(batch)
        servers.shutdown()
    finally:
        pool.release()
        ray.shutdown()
