"""Hugging Face transformers rollout engine (`rollout.name=hf`): the model's weights, rlsp's decoding loop.

Needs nothing beyond transformers; the faster engine for small models on CPU (vLLM's per-step
overhead dominates there) and a second implementation to cross-check the protocol. Prompts are
left-padded into one batch and decoded token by token over a KV cache: for Llama, Qwen2 and Mistral
with rlsp.rollout.lean_decoder (the same arithmetic in about half the ops; equal to transformers'
forward to 1e-10 in float64), for anything else with the model's own forward and `DynamicCache`. Each
token is drawn by rlsp.rollout.sampling (temperature, top-k, top-p as vLLM applies them) and reported
with its logprob under that processed distribution, matching the vLLM engine's `processed_logprobs`.
The loop is `generate`'s decoding without its per-token machinery (logits processors, stopping
criteria, score lists), which costs about a third of the time of a small model's rollout on CPU.
Routing replay R3: given `route_finder`, every call also returns each sample's MoE routes (the top-k experts of
every prompt and response token, per layer; rlsp.rollout.route_capture) in a RoutedOutput.

Legend: B = prompts in the batch, N = B * n samples, P = padded prompt length, R = new tokens, V = vocab.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, DynamicCache

from rlsp.models.family_checks import SINK_FAMILIES
from rlsp.rollout.base import RolloutOutput, SamplingConfig
from rlsp.rollout.hf_vision import check_image_rows, load_generation_model, prefill_inputs, repeat_entries
from rlsp.rollout.hf_vision_turns import embedded_prefill
from rlsp.rollout.lean_decoder import LeanDecoder, unsupported_reason
from rlsp.rollout.route_capture import RouteCapture, RouterFinder
from rlsp.rollout.sampling import sample_next
from rlsp.utils.dtypes import resolve_dtype
from rlsp.utils.logging import get_logger

log = get_logger("rlsp.rollout.hf")


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


def generation_attention(config: Any) -> str | None:
    """"eager" where transformers' sdpa attention would drop a layer's attention soft-capping (Gemma 2: its
    sdpa path ignores `softcap`, and sampled tokens would come from another distribution than the trained
    one) or where the model has attention sinks (gpt-oss: only its eager and flash paths apply them; said
    explicitly rather than left to transformers' choice of default), else None (transformers' default)."""
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "model_type", None) in SINK_FAMILIES:
        return "eager"
    return None


class HFEngine:
    """Rollout engine on one device: a transformers model decoded by rlsp's loop."""

    def __init__(
        self,
        model_path: str,
        dtype: str | torch.dtype = "float32",
        device: str = "cpu",
        seed: int | None = None,
        max_model_len: int | None = None,
        route_finder: RouterFinder | None = None,
        vision_tower: bool = False,
    ) -> None:
        """`seed` makes unseeded `generate` calls reproducible (call k samples with seed + k, as a
        seeded vLLM engine's sampler stream would); `max_model_len` bounds prompt + response; `route_finder`
        (routing replay R3: rlsp.engine.moe_load.find_routers) records each sample's MoE routes; `vision_tower`: a
        Qwen3.5 wrapper checkpoint loads with its vision tower (rows with images; rlsp.rollout.hf_vision)."""
        self.device = torch.device(device)
        self.seed = seed
        self.max_model_len = max_model_len
        self._calls = 0
        config = AutoConfig.from_pretrained(model_path)
        self.model = load_generation_model(model_path, config, resolve_dtype(dtype), generation_attention(config),
                                           vision_tower).to(self.device)
        self.model.eval()
        self.routes = None if route_finder is None else RouteCapture(self.model, route_finder, config.model_type)
        if self.routes is not None:
            log.info("hf rollout engine records the MoE routes of %d layers (routing replay R3)", self.routes.layers)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        eos = self.model.generation_config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [tokenizer.eos_token_id])
        self.stop_ids: set[int] = set(eos_ids)
        self.pad_id: int = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
        self.lean: LeanDecoder | None = None
        self._build_lean()

    def _build_lean(self) -> None:
        """The lean forward where it reproduces the model (rlsp.rollout.lean_decoder), else the model's own."""
        reason = unsupported_reason(self.model)
        self.lean = LeanDecoder(self.model) if reason is None else None
        if reason is not None:
            log.info("hf rollout engine decodes with the model's own forward: the lean decoder does not cover %s", reason)

    def _left_pad(self, prompt_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompt_ids)
        input_ids_BP = torch.full((len(prompt_ids), width), self.pad_id, dtype=torch.long)
        attention_mask_BP = torch.zeros((len(prompt_ids), width), dtype=torch.long)
        for b, ids in enumerate(prompt_ids):
            input_ids_BP[b, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask_BP[b, width - len(ids) :] = 1
        return input_ids_BP.to(self.device), attention_mask_BP.to(self.device)

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig,
                 images: Sequence[Any] | None = None) -> RolloutOutput:
        """`n` samples per prompt; `images`: each prompt's processor outputs (None: no image; rlsp.rollout.hf_vision)."""
        if sampling.ignore_eos:
            raise ValueError("ignore_eos is not supported by the hf rollout engine (its decoding loop stops at EOS); "
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
        if images is not None:
            check_image_rows(self.model, images, len(prompt_ids))
        entries_N = repeat_entries(images, sampling.n) if images is not None else None
        mask_NP = attention_mask_BP.repeat_interleave(sampling.n, dim=0)
        capture = self.routes.capturing() if self.routes is not None else contextlib.nullcontext()
        with _seeded(seed, self.device), capture:
            new_ids_NR, logprobs_NR = self._decode(input_ids_BP.repeat_interleave(sampling.n, dim=0), mask_NP,
                                                   sampling, entries_N)
        out = self._collect(new_ids_NR.tolist(), logprobs_NR.tolist(), sampling.n)
        return out if self.routes is None else self.routes.per_sample(out, mask_NP)

    def _decode(self, input_ids_NP: torch.Tensor, mask_NP: torch.Tensor, sampling: SamplingConfig,
                entries_N: Sequence[Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample up to `max_tokens` tokens per row with the model's KV cache: (tokens [N, R], their
        processed logprobs [N, R]); R < max_tokens when every row stopped early. `entries_N`: each row's images."""
        n_rows, width = input_ids_NP.shape
        forward = self._forward_fn(mask_NP, width + sampling.max_tokens)
        if entries_N is None:
            # Left padding: real tokens take positions 0.. (pads get 0, they are masked out anyway).
            positions_NP = (mask_NP.cumsum(-1) - 1).clamp(min=0)
            logits_NV = forward(input_ids_NP, positions_NP, 0)
            next_pos_N1 = positions_NP[:, -1:] + 1
        else:  # multimodal rope: 3-D positions [3, N, T], decoding on from each prompt's largest
            image_kwargs, positions_3NP, next_pos_N1 = prefill_inputs(self.model, input_ids_NP, mask_NP, entries_N)
            logits_NV = forward(input_ids_NP, positions_3NP, 0, **image_kwargs)
            next_pos_N1 = next_pos_N1.expand(3, -1, -1)
        stop_ids = torch.tensor(sorted(self.stop_ids), dtype=torch.long, device=self.device)
        running_N = torch.ones(n_rows, dtype=torch.bool, device=self.device)
        tokens, logprobs = [], []
        for t in range(sampling.max_tokens):
            token_N, logprob_N = sample_next(logits_NV, sampling)
            tokens.append(token_N)
            logprobs.append(logprob_N)
            running_N &= ~torch.isin(token_N, stop_ids)
            if t + 1 == sampling.max_tokens or not bool(running_N.any()):
                break
            logits_NV = forward(token_N[:, None], next_pos_N1 + t, width + t)
        if self.routes is not None:  # R3: the last sampled token's routes (it is no input of the loop)
            forward(token_N[:, None], next_pos_N1 + t, width + t)
        return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1)

    def _forward_fn(self, mask_NP: torch.Tensor, slots: int) -> Callable[..., torch.Tensor]:
        """forward(ids [N, T], positions [N, T] (multimodal rope: [3, N, T]), first cache slot, **the prefill's image
        kwargs) -> logits [N, V] of the last token, over a cache of `slots` tokens per row that starts empty."""
        key_valid_NS = torch.ones(mask_NP.shape[0], slots, dtype=torch.bool, device=self.device)
        key_valid_NS[:, : mask_NP.shape[1]] = mask_NP.bool()
        if self.lean is not None and self.routes is None:  # the lean forward has no routers to capture
            self.lean.start(mask_NP.shape[0], slots, key_valid_NS)
            return self.lean.forward
        cache, mask_NS = DynamicCache(config=self.model.config), key_valid_NS.long()

        def forward(ids_NT: torch.Tensor, positions_NT: torch.Tensor, slot: int, **images: torch.Tensor) -> torch.Tensor:
            at = {"attention_mask": mask_NS[:, : slot + ids_NT.shape[1]], "position_ids": positions_NT,
                  "past_key_values": cache, "use_cache": True}
            if "image_mask" in images:  # a continued prompt with more image-token ids than images (hf_vision_turns)
                return embedded_prefill(self.model, ids_NT, **images, **at)
            return self.model(input_ids=ids_NT, logits_to_keep=1, **at, **images).logits[:, -1]
        return forward if self.routes is None else self.routes.wrap(forward)

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
            self.lean = None  # its fused weights live on the GPU; wake_up fuses again
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        if self.device.type == "cuda":
            self.model.to(self.device)
            self._build_lean()
