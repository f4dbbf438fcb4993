"""`python -m rlsp.check`: rlsp.main's composition, every problem collected, data and run-length reports.

* the config it checks is the one `python -m rlsp.main` composes (Hydra's own `--cfg job` print);
* problems of every kind (values, unknown and refused keys, verl/rlsp spellings set apart, missing
  files, data) come back together, exit 2; a clean command exits 0 and prints the layout;
* prompts over data.max_prompt_length are counted per filter_overlong_prompts / truncation;
* the run length follows verl's rule, and an existing run dir goes through the resume checks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from omegaconf import OmegaConf

from rlsp.check import main as check_main
from rlsp.check import run_checks
from rlsp.config.compose import compose_config, parse_command_line

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def base(tmp_path) -> list[str]:
    return ["trainer.device=cpu", f"trainer.cache_dir={tmp_path / 'cache'}",
            f"trainer.default_local_dir={tmp_path / 'run'}"]


def _prompts(path: Path, lengths: list[int]) -> str:
    """A verl-layout parquet whose user prompts have the given numbers of characters."""
    rows = [{"data_source": "rlsp/arithmetic", "prompt": [{"role": "user", "content": "1" * n}],
             "reward_model": {"style": "rule", "ground_truth": "1"}, "extra_info": {"index": i}}
            for i, n in enumerate(lengths)]
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


def test_checks_the_config_rlsp_main_composes(tmp_path):
    overrides = ["actor_rollout_ref.rollout.n=4", "trainer.logger=console", "critic.optim.clip_grad=0.5"]
    printed = subprocess.run([sys.executable, "-m", "rlsp.main", "--config-name", "ppo", "--cfg", "job", *overrides],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr[-2000:]
    line = parse_command_line(["--config-name=ppo", *overrides])
    composed = OmegaConf.to_container(compose_config(line.config_name, line.overrides))
    assert composed == yaml.safe_load(printed.stdout)


def test_every_problem_is_listed_at_once(tmp_path, base, capsys):
    rc = check_main([*base, "trainer.device=tpu", "actor_rollout_ref.actor.ulysses_sp=2", "algorithm.use_pf_ppo=true",
                     "data.train_batch_size=abc", "custom_reward_function.path=/a.py", "reward.custom_function_path=/b.py",
                     f"data.train_files={tmp_path / 'missing.parquet'}", "actor_rollout_ref.actor.loss_agg_mode=seq-sum"])
    out = capsys.readouterr().out
    assert rc == 2
    for needle in ("trainer.device='tpu' is not supported; legal values: ['auto', 'cpu', 'cuda']",
                   "unknown config key 'actor_rollout_ref.actor.ulysses_sp'",
                   "algorithm.use_pf_ppo is not supported: pf-PPO",
                   "data.train_batch_size=abc: ",
                   "custom_reward_function.path='/a.py' (verl's spelling) and reward.custom_function_path='/b.py'",
                   "missing.parquet' does not exist",
                   "actor_rollout_ref.actor.loss_agg_mode='seq-sum' is not supported; legal values: ['token-mean'"):
        assert needle in out, (needle, out)
    assert "8 problem(s):" in out


def test_a_clean_command_prints_the_layout_and_exits_0(base, capsys):
    rc = check_main(["--config-name", "ppo", *base, "trainer.nnodes=4", "trainer.n_gpus_per_node=8",
                     "data.train_batch_size=64", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=32", "trainer.total_training_steps=null",
                     "trainer.total_epochs=2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "policy pool: 4 x 8 = 32 workers on nodes 0-3: actor, ref, rollout, critic" in out
    assert "actor:   dp=16 ulysses=2 ring=1 tp=1" in out and "critic:  colocated on the policy pool | dp=32" in out
    assert "actor update: mini-batches of 32 prompts (256 samples, 16 per dp rank) x ppo_epochs=1 = 2" in out
    assert "run: 64 steps (2 epochs x 32 batches; 2048 training prompts, 32 batches per epoch)" in out
    assert "OK: no problems found" in out


@pytest.mark.parametrize("settings,needle,problem", [
    (["data.filter_overlong_prompts=true"], "2 longer than 40 dropped (data.filter_overlong_prompts=true)", False),
    (["data.filter_overlong_prompts=false", "data.truncation=left"], "2 longer than 40 cut (data.truncation=left)", False),
    (["data.filter_overlong_prompts=false", "data.truncation=error"],
     "2 prompts are longer than data.max_prompt_length=40 (up to 69 tokens) and data.truncation=error", True),
])
def test_overlong_prompts_are_counted(tmp_path, base, settings, needle, problem):
    train = _prompts(tmp_path / "train.parquet", [5, 10, 30, 50, 5, 5, 5, 5])
    report = run_checks([*base, f"data.train_files={train}", "data.val_files=null", "data.max_prompt_length=40",
                         "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                         "trainer.total_training_steps=2", *settings])
    where = report.problems if problem else report.sections["data"]
    assert any(needle in line for line in where), (report.problems, report.sections.get("data"))
    assert (report.problems != []) == problem


def test_run_length_follows_verl(tmp_path, base):
    train = _prompts(tmp_path / "train.parquet", [5] * 10)
    common = [*base, f"data.train_files={train}", "data.val_files=null", "data.train_batch_size=4",
              "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
    report = run_checks([*common, "trainer.total_training_steps=null", "trainer.total_epochs=3"])
    assert report.sections["schedule"][0].startswith("run: 6 steps (3 epochs x 2 batches; 10 training prompts")
    report = run_checks([*common, "trainer.total_training_steps=7", "trainer.total_epochs=3"])
    assert report.problems == ["trainer.total_training_steps=7 exceeds trainer.total_epochs=3 x 2 batches per epoch = "
                               "6 steps; raise trainer.total_epochs or lower total_training_steps"]


def test_an_existing_run_dir_goes_through_the_resume_checks(tmp_path, base):
    (tmp_path / "run").mkdir()
    assert run_checks(base).sections["resume"] == [f"run dir {tmp_path / 'run'}: a fresh run"]
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    problems = run_checks(base).problems
    assert len(problems) == 1 and "already holds a run (metrics of 1 steps and no checkpoint)" in problems[0]


def test_rlsp_main_refuses_verl_keys_by_name_before_hydra(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rlsp.main", "global_profiler.tool=nsys", "trainer.logger=console",
                           "actor_rollout_ref.actor.profiler.enable=True"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={**os.environ, "RAY_ADDRESS": ""})
    assert proc.returncode == 2
    assert "global_profiler.tool is not supported: profiler back-ends" in proc.stderr
    assert "actor_rollout_ref.actor.profiler.enable is not supported" in proc.stderr
    assert not (tmp_path / "outputs").exists()  # refused before Hydra made a run dir
