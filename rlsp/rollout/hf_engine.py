"""Hugging Face `generate` rollout engine: the fallback behind the `RolloutEngine` protocol.

Slower than vLLM but dependency-free; useful where vLLM is not installed and as a second
implementation to cross-check the protocol. Prompts are left-padded into one batch; the logprob of
each sampled token is taken from the processed scores `generate` sampled from (temperature and
top-k/top-p applied), matching the vLLM engine's `processed_logprobs`.

Legend: B = prompts in the batch, N = B * n samples, P = padded prompt length, R = new tokens, V = vocab.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from rlsp.rollout.base import RolloutOutput, SamplingConfig
from rlsp.utils.dtypes import resolve_dtype


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Seed sampling without disturbing the caller's global RNG streams."""
    if seed is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


class HFEngine:
    """Rollout engine using `transformers` generate on one device."""

    def __init__(
        self,
        model_path: str,
        dtype: str | torch.dtype = "float32",
        device: str = "cpu",
        seed: int | None = None,
        max_model_len: int | None = None,
    ) -> None:
        """`seed` makes unseeded `generate` calls reproducible (call k samples with seed + k, as a
        seeded vLLM engine's sampler stream would); `max_model_len` bounds prompt + response."""
        self.device = torch.device(device)
        self.seed = seed
        self.max_model_len = max_model_len
        self._calls = 0
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=resolve_dtype(dtype)).to(self.device)
        self.model.eval()
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        eos = self.model.generation_config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [tokenizer.eos_token_id])
        self.stop_ids: set[int] = set(eos_ids)
        self.pad_id: int = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
        self._eos_ids = eos_ids

    def _generation_config(self, sampling: SamplingConfig) -> GenerationConfig:
        sample = not sampling.is_greedy
        return GenerationConfig(
            max_new_tokens=sampling.max_tokens,
            do_sample=sample,
            temperature=sampling.temperature if sample else None,
            top_p=sampling.top_p if sample else None,
            # 0 disables top-k explicitly; None would fall back to transformers' default of 50.
            top_k=max(sampling.top_k, 0) if sample else None,
            num_return_sequences=sampling.n,
            eos_token_id=self._eos_ids,
            pad_token_id=self.pad_id,
            bos_token_id=None,
            output_scores=True,
            return_dict_in_generate=True,
        )

    def _left_pad(self, prompt_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompt_ids)
        input_ids_BP = torch.full((len(prompt_ids), width), self.pad_id, dtype=torch.long)
        attention_mask_BP = torch.zeros((len(prompt_ids), width), dtype=torch.long)
        for b, ids in enumerate(prompt_ids):
            input_ids_BP[b, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask_BP[b, width - len(ids) :] = 1
        return input_ids_BP.to(self.device), attention_mask_BP.to(self.device)

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> RolloutOutput:
        if sampling.ignore_eos:
            raise ValueError("ignore_eos is not supported by the hf rollout engine (generate stops at EOS); "
                             "use actor_rollout_ref.rollout.name=vllm")
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise ValueError("generate needs at least one prompt and every prompt needs >= 1 token")
        longest = max(len(p) for p in prompt_ids)
        if self.max_model_len is not None and longest + sampling.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt of {longest} tokens + max_tokens={sampling.max_tokens} exceeds max_model_len={self.max_model_len}"
            )
        seed = sampling.seed
        if seed is None and self.seed is not None:
            seed = self.seed + self._calls
        self._calls += 1
        input_ids_BP, attention_mask_BP = self._left_pad(prompt_ids)
        with _seeded(seed, self.device):
            result = self.model.generate(
                input_ids=input_ids_BP,
                attention_mask=attention_mask_BP,
                generation_config=self._generation_config(sampling),
            )
        width = input_ids_BP.shape[1]
        new_ids_NR = result.sequences[:, width:]
        scores_NRV = torch.stack(result.scores, dim=1).float()
        logprobs_NR = torch.log_softmax(scores_NRV, dim=-1).gather(-1, new_ids_NR.unsqueeze(-1)).squeeze(-1)
        return self._collect(new_ids_NR.tolist(), logprobs_NR.tolist(), sampling.n)

    def _collect(self, new_ids: list[list[int]], logprobs: list[list[float]], n: int) -> RolloutOutput:
        out = RolloutOutput()
        for row, (ids, lps) in enumerate(zip(new_ids, logprobs)):
            stop_at = next((t for t, tok in enumerate(ids) if tok in self.stop_ids), None)
            if stop_at is None:
                out.append(row // n, ids, lps, "length")
            else:
                out.append(row // n, ids[: stop_at + 1], lps[: stop_at + 1], "stop")
        return out

    @torch.no_grad()
    def prompt_logprobs(self, token_ids: list[int]) -> list[float | None]:
        input_ids_1T = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        logits_TV = self.model(input_ids=input_ids_1T).logits[0].float()
        logprobs_T = torch.log_softmax(logits_TV[:-1], dim=-1).gather(-1, input_ids_1T[0, 1:, None]).squeeze(-1)
        return [None] + logprobs_T.tolist()

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the received tensors into the model; unknown names raise (a silent no-op would
        leave the engine sampling from stale weights)."""
        params = dict(self.model.named_parameters())
        params.update({k: v for k, v in self.model.named_buffers() if k not in params})
        if self.model.config.tie_word_embeddings:
            params.setdefault("lm_head.weight", self.model.get_output_embeddings().weight)
        for name, tensor in named_tensors:
            if name not in params:
                raise ValueError(f"update_weights: unknown parameter {name!r}; known: {sorted(params)[:8]}...")
            if params[name].shape != tensor.shape:
                raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, model has {tuple(params[name].shape)}")
            params[name].copy_(tensor.to(device=self.device, dtype=params[name].dtype))

    def sleep(self) -> None:
        """Move the weights off the GPU; no-op on CPU."""
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        if self.device.type == "cuda":
            self.model.to(self.device)
