"""reward.reward_manager.name=gdpo: verl's gdpo manager scores like naive (the reward function once per row, a
returned dict's entries kept per row for algorithm.gdpo_reward_keys) and adds the run's trainer.experiment_name
to every row's extra_info. verl's gdpo example command (examples/gdpo_trainer/run_qwen3_8b_fsdp.sh at v0.9.0)
passes `python -m rlsp.check --config-name verl` with local model and data paths."""

from __future__ import annotations

import pytest
import torch
from test_verl_commands import _problems, build_local, localize

from rlsp.check import main as check_main
from rlsp.config.choices import REWARD_MANAGERS
from rlsp.data.batch import Batch
from rlsp.models.tokenizer import build_char_tokenizer
from rlsp.rewards.scoring import Scorer, manager_extra_info

# the reward function of verl's gdpo example reads extra_info["experiment_name"] (it picks the chat format by it)
REWARD_FN = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    name = extra_info["experiment_name"]
    accuracy = 1.0 if ground_truth in solution_str else 0.0
    return {"score": accuracy + 0.5, "accuracy_reward": accuracy, "format_reward": 0.5, "name": name}
'''

GDPO_COMMAND = [  # verl 0.9.0 examples/gdpo_trainer/run_qwen3_8b_fsdp.sh, its defaults expanded
    "algorithm.adv_estimator=gdpo", '+algorithm.gdpo_reward_keys=["accuracy_reward","format_reward"]',
    "algorithm.kl_ctrl.kl_coef=0.001", "data.train_files=$DATA_DIR/train.parquet",
    "data.val_files=$DATA_DIR/test.parquet", "data.train_batch_size=128", "data.max_prompt_length=2048",
    "data.max_response_length=2048", "data.filter_overlong_prompts=True", "data.truncation=error",
    "actor_rollout_ref.model.path=Qwen/Qwen3-8B", "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True", "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576", "actor_rollout_ref.actor.use_kl_loss=False",
    "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False", "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24576",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=24576",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "reward.custom_reward_function.path=$REPO_ROOT/verl/utils/reward_score/rlla.py",
    "reward.custom_reward_function.name=compute_score", "reward.reward_manager.name=gdpo",
    "trainer.balance_batch=True", "trainer.critic_warmup=0", 'trainer.logger=["console","wandb"]',
    "trainer.project_name=verl_gdpo", "trainer.experiment_name=qwen3_8b_vllm_fsdp", "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1", "trainer.val_before_train=False", "trainer.save_freq=20", "trainer.test_freq=10",
    "trainer.total_epochs=15",
]


def _rows(tokenizer, texts: list[str]) -> Batch:
    """One-token responses (no prompt columns), as tests/unit/test_scoring.py builds them."""
    ids = torch.tensor([tokenizer.encode(t, add_special_tokens=False) for t in texts])
    n = len(texts)
    return Batch.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                            "response_mask": torch.ones(n, ids.shape[1])},
                           meta={"data_source": ["x"] * n, "ground_truth": ["7"] * n,
                                 "extra_info": [{"index": i} for i in range(n)], "index": list(range(n))})


def test_gdpo_manager_adds_the_experiment_name_and_keeps_the_components(tmp_path):
    path = tmp_path / "fn.py"
    path.write_text(REWARD_FN)
    tok = build_char_tokenizer()
    assert "gdpo" in REWARD_MANAGERS
    scorer = Scorer(tok, str(path), row_extra=manager_extra_info("gdpo", "qwen3_8b"))
    batch = _rows(tok, ["7", "3"])
    scores = scorer.score_rows(batch)
    assert scores.tolist() == [1.5, 0.5]
    extra = batch.meta["reward_extra_info"]
    assert [e["accuracy_reward"] for e in extra] == [1.0, 0.0] and {e["name"] for e in extra} == {"qwen3_8b"}
    assert batch.meta["extra_info"] == [{"index": 0}, {"index": 1}]  # the dataset's rows are not changed
    assert manager_extra_info("naive", "qwen3_8b") == {} == manager_extra_info("dapo", "x")
    with pytest.raises(RuntimeError, match="experiment_name"):  # naive adds nothing: the function's KeyError
        Scorer(tok, str(path)).score_rows(_rows(tok, ["7"]))


def test_unknown_manager_names_the_legal_ones(tmp_path, capsys):
    local = build_local(tmp_path, 256)
    rc = check_main(localize(["reward.reward_manager.name=gdp0"], local))
    problems = _problems(capsys.readouterr().out)
    assert rc != 0 and any("'gdp0'" in p and "'naive', 'dapo', 'gdpo'" in p for p in problems), problems


def test_verl_gdpo_example_passes_rlsp_check(tmp_path, capsys):
    local = build_local(tmp_path, 256)
    fn = tmp_path / "rlla.py"
    fn.write_text(REWARD_FN)
    command = [a.replace("$REPO_ROOT/verl/utils/reward_score/rlla.py", str(fn)) for a in GDPO_COMMAND]
    rc = check_main(localize(command, local))
    out = capsys.readouterr().out
    assert rc == 0 and not _problems(out), _problems(out)
    assert "reward.reward_manager.name: naive, dapo or gdpo" in out  # the note says what gdpo does
