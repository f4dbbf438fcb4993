"""reward_model.num_workers: rule scoring in Ray scoring actors, or (0) in the policy workers, gives what
one in-process Scorer gives.

7 rows (one chunk, uneven chunks over 2 and 3 workers), a custom reward that depends on each row's response and
index, and one faulting row scored 0 under reward.on_error=zero: token-level scores, per-row scores
and the error count are equal exactly. A scorer that dies is named.
"""

from __future__ import annotations

import pytest
import ray
import torch
from omegaconf import OmegaConf

from rlsp.config.schema import RLSPConfig
from rlsp.config.validate import validate_config
from rlsp.controller.reward_workers import ScoringPool, start_scoring_processes
from rlsp.controller.worker_group import WorkerDiedError
from rlsp.controller.worker_process import WorkerProcess
from rlsp.data.batch import Batch
from rlsp.models.tokenizer import build_char_tokenizer
from rlsp.rewards.scoring import Scorer

pytestmark = pytest.mark.e2e

BODY = ("    if extra_info['index'] == 13:\n        raise ValueError('bad row')\n"
        "    return len(solution_str) + 0.1 * extra_info['index']\n")


def _batch(tok, n: int = 7) -> Batch:
    rows = [tok.encode(str(10 ** (i % 4)), add_special_tokens=False) for i in range(n)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows])
    return Batch.from_dict({"input_ids": ids, "response_mask": mask},
                           meta={"data_source": ["src"] * n, "ground_truth": ["1"] * n,
                                 "extra_info": [{"index": 10 + i} for i in range(n)], "index": [10 + i for i in range(n)]})


def test_reward_workers_equal_one_scorer(tmp_path):
    tok = build_char_tokenizer()
    tok.save_pretrained(str(tmp_path / "tok"))
    fn = tmp_path / "score.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" + BODY)
    single = Scorer(tok, str(fn), on_error="zero")
    expected = _batch(tok)
    want = single.score_rows(expected)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for workers in (1, 2, 3):
            pool = ScoringPool(start_scoring_processes(workers, str(tmp_path / "tok"), str(fn), "compute_score", "zero"))
            batch = _batch(tok)
            got = pool.score_rows(batch)
            assert got.tolist() == want.tolist()
            assert torch.equal(batch["token_level_scores"], expected["token_level_scores"])
            assert pool.last_errors == single.last_errors == 1
        # reward_model.num_workers=0: the policy workers' own `score` (no process group needed to score)
        cfg = OmegaConf.structured(RLSPConfig)
        for key, val in {"actor_rollout_ref.model.path": str(tmp_path / "tok"), "reward.custom_function_path": str(fn),
                         "reward.on_error": "zero", "trainer.device": "cpu"}.items():
            OmegaConf.update(cfg, key, val)
        layout = validate_config(cfg)
        assert cfg.reward_model.num_workers == 0  # auto: no rollout pool, so the policy workers score
        config = OmegaConf.to_container(cfg)
        workers = [ray.remote(WorkerProcess).remote(layout, "policy", rank) for rank in range(2)]
        ray.get([w.configure.remote(config) for w in workers])  # the config alone: no process group to score
        batch = _batch(tok)
        assert ScoringPool(workers).score_rows(batch).tolist() == want.tolist()
        assert torch.equal(batch["token_level_scores"], expected["token_level_scores"])
        # a policy worker that dies while it scores is named, as in every other call of the step
        ray.kill(workers[1])
        with pytest.raises(WorkerDiedError, match="policy worker rank 1 of 2 died"):
            ScoringPool(workers, lambda r: f"policy worker rank {r} of 2").score_rows(_batch(tok))
    finally:
        ray.shutdown()
