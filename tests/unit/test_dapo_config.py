"""DAPO's keys at start-up: the reward manager and overlong shaping under verl's new (`reward.*`, added with `+`)
and older (`reward_model.*`) spellings, dynamic sampling's `algorithm.filter_groups.*`; each bad value refused
naming the key, the value and what is legal."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from rlsp.check import run_checks
from rlsp.config.schema import RLSPConfig
from rlsp.config.validate import validate_config
from rlsp.rewards.overlong import OverlongShaping, build_overlong_shaping
from rlsp.step.dynamic_sampling import build_dynamic_sampler

BUF = "reward.reward_kwargs.overlong_buffer_cfg."


def make(**overrides):
    cfg = OmegaConf.structured(RLSPConfig)
    for key, val in overrides.items():
        OmegaConf.update(cfg, key, val)
    return cfg


def _errors(**overrides) -> str:
    with pytest.raises(ValueError) as err:
        validate_config(make(**overrides))
    return str(err.value)


DAPO_ON = {"reward.reward_manager.name": "dapo", BUF + "enable": True, BUF + "len": 4, BUF + "penalty_factor": 1.0}


def test_defaults_are_naive_without_filtering():
    cfg = make()
    validate_config(cfg)
    assert build_overlong_shaping(cfg) is None and build_dynamic_sampler(cfg) is None


def test_new_spelling_builds_the_shaping_and_the_sampler():
    cfg = make(**DAPO_ON, **{BUF + "log": True, "algorithm.filter_groups.enable": True,
                             "algorithm.filter_groups.metric": "seq_reward",
                             "algorithm.filter_groups.max_num_gen_batches": 5})
    validate_config(cfg)
    # max_resp_len null: data.max_response_length (8 in the default config)
    assert build_overlong_shaping(cfg) == OverlongShaping(max_resp_len=8, buffer_len=4, penalty_factor=1.0, log=True)
    sampler = build_dynamic_sampler(cfg)
    assert (sampler.metric, sampler.train_batch_size, sampler.max_num_gen_batches) == ("seq_reward", 16, 5)
    # dapo without the buffer scores as naive does
    assert build_overlong_shaping(make(**{"reward.reward_manager.name": "dapo"})) is None


def test_older_spelling_is_mapped_onto_the_new_keys():
    cfg = make(**{"reward_model.reward_manager": "dapo", "reward_model.overlong_buffer.enable": True,
                  "reward_model.overlong_buffer.len": 2, "reward_model.overlong_buffer.penalty_factor": 0.5,
                  "reward_model.overlong_buffer.log": True})
    validate_config(cfg)
    assert cfg.reward.reward_manager.name == "dapo" and cfg.reward_model.reward_manager is None
    assert build_overlong_shaping(cfg) == OverlongShaping(8, 2, 0.5, True)
    msg = _errors(**{"reward_model.overlong_buffer.len": 2, BUF + "len": 3})
    assert "reward_model.overlong_buffer.len=2 (verl's spelling) and reward.reward_kwargs.overlong_buffer_cfg.len=3" in msg


@pytest.mark.parametrize("overrides,needle", [
    ({"reward.reward_manager.name": "prime"},
     "reward.reward_manager.name='prime' is not supported (reward managers other than naive, dapo and gdpo"),
    ({"reward.reward_manager.name": "fancy"}, "reward.reward_manager.name='fancy' is not supported; legal values: "
                                              "['naive', 'dapo', 'gdpo']"),
    ({**DAPO_ON, "reward.reward_manager.name": "naive"},
     f"{BUF}enable=true needs reward.reward_manager.name=dapo (got 'naive'"),
    ({**DAPO_ON, BUF + "len": 0}, f"{BUF}len=0 must be an integer in [1, 8]"),
    ({**DAPO_ON, BUF + "len": 9}, f"{BUF}len=9 must be an integer in [1, 8]"),
    ({**DAPO_ON, BUF + "penalty_factor": -1.0}, f"{BUF}penalty_factor=-1.0 must be a finite number >= 0"),
    ({**DAPO_ON, "reward.reward_kwargs.max_resp_len": 6},
     "reward.reward_kwargs.max_resp_len=6 must equal data.max_response_length=8"),
    ({**DAPO_ON, "reward_model.enable": True, "reward_model.model.path": "/rm"},
     f"{BUF}enable=true with reward_model.enable=true: the reward model's scores replace the rule rewards"),
    ({"algorithm.filter_groups.enable": True},
     "algorithm.filter_groups.metric=None is not supported; legal values: ['acc', 'score', 'seq_reward', "
     "'seq_final_reward']"),
    ({"algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "entropy"},
     "algorithm.filter_groups.metric='entropy' is not supported"),
    ({"algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "acc",
      "actor_rollout_ref.rollout.n": 1, "algorithm.adv_estimator": "reinforce_plus_plus"},
     "actor_rollout_ref.rollout.n=1 must be >= 2"),
    ({"algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "seq_final_reward",
      "algorithm.use_kl_in_reward": True},
     "algorithm.filter_groups.metric='seq_final_reward' with algorithm.use_kl_in_reward=true is not supported"),
])
def test_bad_values_are_refused_by_name(overrides, needle):
    assert needle in _errors(**overrides)


def test_gen_batch_size_sets_the_generation_round_and_the_run_length():
    from rlsp.config.run_length import planned_steps

    cfg = make(**{"algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "acc",
                  "data.gen_batch_size": 48, "trainer.total_epochs": 2})
    validate_config(cfg)
    assert build_dynamic_sampler(cfg).collector().prompts_per_batch == 48
    # verl's rule: the loader's batches are generation batches: 2 epochs x (2048 // 48 = 42) = 84 steps
    assert planned_steps(cfg, 2048) == (84, 84)
    assert planned_steps(make(), 2048)[0] == 30 * (2048 // 16)
    assert build_dynamic_sampler(make(**{"algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric":
                                         "acc"})).collector().prompts_per_batch == 16  # null: train_batch_size
    msg = _errors(**{"data.gen_batch_size": 48})
    assert "data.gen_batch_size=48 differs from data.train_batch_size=16: only dynamic sampling" in msg
    msg = _errors(**{"algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "acc",
                     "data.gen_batch_size": 0})
    assert "data.gen_batch_size=0 must be an integer >= 1 or null" in msg
    msg = _errors(**{"algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "acc",
                     "data.gen_batch_size": 32, "rollout.n_gpus_per_node": 1, "trainer.n_gpus_per_node": 1})
    assert "data.gen_batch_size=32 differs from data.train_batch_size=16: the asynchronous rollout pool" in msg
    validate_config(make(**{"data.gen_batch_size": 16}))  # equal: accepted without filtering


def test_max_resp_len_equal_to_the_generation_limit_is_accepted():
    validate_config(make(**DAPO_ON, **{"reward.reward_kwargs.max_resp_len": 8}))
    validate_config(make(**{"reward.reward_kwargs.max_resp_len": 8, BUF + "len": 0}))  # off: len not read


def test_verl_dapo_commands_pass_rlsp_check(tmp_path):
    common = ["trainer.device=cpu", f"trainer.default_local_dir={tmp_path / 'run'}",
              f"trainer.cache_dir={tmp_path / 'cache'}", "data.max_response_length=8",
              "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
              "actor_rollout_ref.actor.loss_agg_mode=token-mean", "algorithm.filter_groups.enable=True",
              "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=10",
              "data.train_batch_size=16", "data.gen_batch_size=48"]
    new = ["reward.reward_manager.name=dapo", "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
           "+reward.reward_kwargs.overlong_buffer_cfg.len=4", "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
           "+reward.reward_kwargs.overlong_buffer_cfg.log=False", "+reward.reward_kwargs.max_resp_len=8"]
    old = ["reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=True",
           "reward_model.overlong_buffer.len=4", "reward_model.overlong_buffer.penalty_factor=1.0"]
    for command in (new, old):
        report = run_checks(common + command)
        assert report.problems == [], report.problems
    report = run_checks(common + ["reward_model.reward_manager=batch"])
    assert any("reward.reward_manager.name='batch' is not supported" in p for p in report.problems), report.problems
