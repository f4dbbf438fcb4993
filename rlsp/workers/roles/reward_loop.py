"""The reward loop's engine on a policy worker (reward_model.use_reward_loop=true, verl's reward loop).

A vLLM pooling engine (rlsp.rollout.vllm_reward) serves the reward model; the ranks of one
tensor-parallel group (`reward_model.rollout.tensor_model_parallel_size` consecutive workers) build
one engine together and get the same rows (the role's `compute_rm_score` is dispatched by dp group
of the reward model's layout). Where the policy workers' vLLM rollout engine uses another tensor
parallel degree (vLLM keeps one per process), single-rank reward engines run in processes of their
own instead, one per policy worker (rlsp.controller.reward_servers). Each sample is rendered as verl's reward-loop worker does: the
response decoded with the policy tokenizer, appended as the assistant turn to the prompt's chat,
formatted with the reward model's chat template, a leading BOS text dropped and the engine's
tokenizer adding its special tokens (rlsp.data.rm_inputs). The score is the model's raw output at the
last token; an input longer than the engine's max_model_len is refused, as verl's server refuses it.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig
from transformers import AutoTokenizer

from rlsp.data.batch import Batch
from rlsp.data.rm_inputs import render_for_reward_model
from rlsp.rollout.vllm_reward import VLLMRewardEngine


class RewardLoopScorer:
    """One reward engine (or this rank's tp shard of one) and the rendering of rows.

    `tp`: the engine's tensor-parallel degree, the layout's (`layout.role("reward_model").tp`).
    `in_process_group`: the engine joins this process's torch.distributed world (a policy worker's
    ranks, `tp` of them per engine); False: a process of its own (rlsp.controller.reward_servers), one
    single-rank engine with vLLM's own one-process world.
    """

    def __init__(self, cfg: DictConfig, tp: int = 1, in_process_group: bool = True) -> None:
        rm = cfg.reward_model
        r = rm.rollout
        if not in_process_group and tp != 1:
            raise ValueError(f"reward_model.rollout.tensor_model_parallel_size={tp}: a reward "
                             "engine in a process of its own has one rank; legal value: 1")
        self.prompt_len = int(cfg.data.max_prompt_length)
        self.engine = VLLMRewardEngine(
            rm.model.path, dtype=r.dtype, max_model_len=r.max_model_len,
            tensor_parallel_size=tp,
            gpu_memory_utilization=r.gpu_memory_utilization, enforce_eager=r.enforce_eager, load_format=r.load_format,
            max_num_seqs=r.max_num_seqs, max_num_batched_tokens=r.max_num_batched_tokens,
            cpu_kvcache_space_gib=r.cpu_kvcache_space_gib, seed=cfg.trainer.seed,
            distributed_executor_backend="external_launcher" if in_process_group else None)
        self.free_cache_engine = bool(r.free_cache_engine)
        if self.free_cache_engine:
            self.engine.sleep()
        self.tokenizer = AutoTokenizer.from_pretrained(rm.model.path)
        self.input_tokenizer: Any = AutoTokenizer.from_pretrained(rm.model.input_tokenizer or cfg.actor_rollout_ref.model.path)

    def rows(self, batch: Batch) -> Batch:
        return render_for_reward_model(batch, self.prompt_len, self.input_tokenizer, self.tokenizer,
                                       self.engine.max_model_len, engine_specials=True)

    def scores(self, batch: Batch) -> list[float]:
        """One raw score per row of `batch` (rollout rows with meta["messages"])."""
        rows = self.rows(batch)
        lengths = rows["attention_mask"].sum(-1).tolist()
        ids = [rows["input_ids"][b, :n].tolist() for b, n in enumerate(lengths)]
        self.engine.wake_up()
        out = self.engine.score(ids)
        if self.free_cache_engine:
            self.engine.sleep()
        return out
