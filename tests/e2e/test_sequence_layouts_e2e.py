"""End to end through the CLI: sequence layouts beyond one Ulysses group give the data-parallel run's step.

With the same workers (so the same rollouts, which are generated per rank), a run whose training
splits every sequence over ulysses x ring ranks must reproduce the plain data-parallel run's
first-step metrics: the same rewards, and the same losses, entropy and gradient norm to fp32
precision (the update is exact whatever the layout). The start-up self-check must pass for every
sharded role. The bounds are derived in tests/tolerances.py from the run's model and batch (`run_tolerances`).

* GRPO on 4 workers, actor and reference at (ulysses 2, ring 2), at TP 2 with sequence-parallel
  activations x dp 2, and at adaptive Ulysses 2 x dp 2 (token budgets), vs dp=4;
* PPO, actor at ring 2 and the critic at ring 2 on 2 workers vs dp=2.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from test_grpo_e2e import _main
from tolerances import decoder_chain, model_rtol, scalar_tol
from transformers import AutoConfig

from rlsp.run.assets import resolve_model_path

pytestmark = pytest.mark.e2e

# One optimizer step over the whole batch: with several mini-batches their composition would depend on
# the dp size (each dp shard is split), so only the first would be comparable.
ONE_STEP = ("trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.test_freq=-1",
            "trainer.save_final_model=false", "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4")
EXACT = ("reward/mean", "response_length/mean")
CLOSE = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm")
CRITIC = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm")
GRAD_NORMS = ("actor/grad_norm", "critic/grad_norm")  # carry the gradients' (backward) roundoff


def run_tolerances(run_dir: Path) -> tuple[float, float, float]:
    """(metric rtol, gradient rtol, logprob scale) of two computations of one step of the run whose
    default_local_dir is `run_dir` (tests/tolerances.py): `model_rtol` of its model's forward and
    forward + backward over a step's tokens, batch x samples x (prompt + response) with padding (the
    longest token reduction, an upper bound); a policy loss metric carries logprobs' roundoff, log(vocab)."""
    return config_tolerances(OmegaConf.load(run_dir / "config.yaml"))


def config_tolerances(cfg) -> tuple[float, float, float]:
    """`run_tolerances` of a run's config."""
    config = AutoConfig.from_pretrained(resolve_model_path(cfg.actor_rollout_ref.model.path, cfg.trainer.cache_dir))
    tokens = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n * (
        cfg.data.max_prompt_length + cfg.data.max_response_length)
    return model_rtol(config, tokens, backward=False), model_rtol(config, tokens), math.log(decoder_chain(config).vocab_size)


def run_logprob_tol(run_dir: Path) -> float:
    """A logprob computed by two forwards of the run's model (vLLM's against the trainer's, sharded against
    unsharded): derivation 4 of tests/tolerances.py, at log(vocab). The same bound after a weight sync: both
    sides compute from the same synced weights; a failed sync moves logprobs by O(0.1-1)."""
    metric_rtol, _, scale = run_tolerances(run_dir)
    return scalar_tol(scale, metric_rtol)


def _first_step(tmp_path, name: str, *overrides: str, config_name: str | None = None) -> tuple[dict, str, Path]:
    run = tmp_path / name
    run.mkdir()
    proc = _main(run, *ONE_STEP, *overrides, config_name=config_name)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = (run / "run" / "metrics.jsonl").read_text().splitlines()
    return json.loads(lines[0]), proc.stderr, run / "run"


def assert_same_step(sharded: dict, plain: dict, keys: tuple[str, ...], run_dir: Path) -> None:
    """Rewards and lengths exactly (the same rollouts); each metric in `keys` within the bound
    `run_tolerances` derives for the reference run at `run_dir`: a gradient norm relative to itself at the
    gradients' rtol, an actor loss metric at the forward's rtol on the scale of a logprob, a critic one
    (values, a clip fraction) at the forward's rtol on its own scale."""
    for key in EXACT:
        assert sharded[key] == plain[key], (key, sharded[key], plain[key])
    metric_rtol, grad_rtol, scale = run_tolerances(run_dir)
    for key in keys:
        rtol, floor = (grad_rtol, 1.0) if key in GRAD_NORMS else (metric_rtol, scale if key.startswith("actor/") else 1.0)
        tol = scalar_tol(max(abs(plain[key]), floor), rtol)
        assert abs(sharded[key] - plain[key]) <= tol, (key, sharded[key], plain[key], tol)


FOUR = ("trainer.n_gpus_per_node=4",)
ACTOR = "actor_rollout_ref.actor."


@pytest.fixture(scope="module")
def grpo_dp4(tmp_path_factory) -> tuple[dict, Path]:
    metrics, _, run_dir = _first_step(tmp_path_factory.mktemp("grpo"), "dp", *FOUR)
    return metrics, run_dir


@pytest.mark.parametrize("degrees,shown", [
    ({"ulysses_sequence_parallel_size": 2, "ring_sequence_parallel_size": 2}, "dp=1 ulysses=2 ring=2 tp=1"),
    ({"tensor_model_parallel_size": 2}, "dp=2 ulysses=1 ring=1 tp=2 (sequence-parallel activations)"),
    # rows of <= 24 tokens at degree 1 (one rank each), longer ones over the pair
    ({"ulysses_sequence_parallel_size": 2, "sequence_parallel_adaptive": True, "use_dynamic_bsz": True,
      "ppo_max_token_len_per_gpu": 24}, "dp=2 ulysses=2 (adaptive) ring=1 tp=1")])
def test_grpo_sequence_and_tensor_layouts_match_data_parallel(tmp_path, grpo_dp4, degrees, shown):
    extra = ("actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=24",
             ) if "sequence_parallel_adaptive" in degrees else ()
    sharded, log, _ = _first_step(tmp_path, "sharded", *FOUR, *(f"{ACTOR}{k}={v}" for k, v in degrees.items()),
                                  *extra)
    assert "sp self-check passed (actor)" in log and shown in log
    plain, plain_dir = grpo_dp4
    assert_same_step(sharded, plain, CLOSE, plain_dir)
    # each rank's outputs cover a quarter (ulysses x ring) or half (tp with SP) of its dp shard's tokens
    assert sharded["sp/tokens_per_rank"] > 0 and plain["sp/tokens_per_rank"] > 0


def test_ppo_critic_and_actor_at_ring_2_match_data_parallel(tmp_path):
    plain, _, plain_dir = _first_step(tmp_path, "dp", config_name="ppo")
    ring, log, _ = _first_step(tmp_path, "ring", "critic.ring_sequence_parallel_size=2",
                            f"{ACTOR}ring_sequence_parallel_size=2", config_name="ppo")
    assert "sp self-check passed (critic)" in log and "sp self-check passed (actor)" in log
    assert_same_step(ring, plain, CLOSE + CRITIC, plain_dir)
