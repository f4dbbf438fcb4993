"""The hf rollout engine's lean decoding forward against transformers' own forward of the same model.

* Llama, Qwen2 and Mistral shapes (biases or not, GQA and MHA, an explicit head_dim, tied or untied
  lm_head, llama3 RoPE scaling): the logits of a ragged, left-padded prefill and of every following
  one-token step equal the model's forward over the whole sequence without a cache (float64, within
  tests/tolerances.py's `logprob_tol` for two forwards of the model at the logits' scale: `_tol`);
* in bfloat16 the lean forward is no further from the float64 logits than transformers' own bf16 forward
  (x 1.5 + one bf16 ulp of the logits' scale: the same ops, reassociated);
* the engine decodes the same tokens with the same logprobs with and without it, and weight sync
  (`update_weights`' in-place copies) reaches its fused q/k/v and gate/up weights;
* models it does not reproduce are named with the reason and decode with the model's own forward.

The forward comparisons run on CPU and, where a GPU is present, on CUDA (scripts/gpu_check.sh runs them).
transformers computes RMSNorm in float32 even in a float64 model, and so does the lean forward; on CPU torch's
`rms_norm` is the same decomposition, bit for bit, but CUDA's fused kernel reduces in another order (~1e-6
in the logits). So every float64 comparison also runs with every RMSNorm computed in float64 on both sides
(`norms_in_float64`): the rest of the arithmetic must agree to that float64 bound on any device, and on CPU
the forwards as they run (float32 norms, the same on both sides) must too.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from tolerances import logprob_tol
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlsp.models.tiny import TinyModelSpec, build_tiny_model
from rlsp.rollout import lean_decoder
from rlsp.rollout.base import SamplingConfig
from rlsp.rollout.hf_engine import HFEngine
from rlsp.rollout.lean_decoder import LeanDecoder, unsupported_reason

PROMPTS = [[5, 9, 12, 7], [20], [33, 4, 8], [11, 11, 40, 41, 42, 43]]
STEPS = 5
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                             reason="needs a CUDA device")])]
COMMON = dict(vocab_size=64, hidden_size=48, intermediate_size=80, num_hidden_layers=2, max_position_embeddings=64,
              rms_norm_eps=1e-6, initializer_range=0.3)


def families() -> dict[str, torch.nn.Module]:
    return {
        "qwen2_gqa_bias_tied": Qwen2ForCausalLM(Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                                                            tie_word_embeddings=True)),
        "llama_mha_head_dim_untied": LlamaForCausalLM(LlamaConfig(**COMMON, num_attention_heads=3, num_key_value_heads=3,
                                                                  head_dim=20, tie_word_embeddings=False)),
        "llama_attention_bias_llama3_rope": LlamaForCausalLM(LlamaConfig(
            **COMMON, num_attention_heads=4, num_key_value_heads=1, attention_bias=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
        "mistral_gqa": MistralForCausalLM(MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=1,
                                                        sliding_window=None)),
    }


def left_padded(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _tol(model, ref: torch.Tensor) -> float:
    """The lean forward against transformers' over a prompt and its steps: two float64 kernels of the model
    (measured: <= 1/3 of it)."""
    return logprob_tol(model.config, max(map(len, PROMPTS)) + STEPS, dtype=torch.float64,
                       value_scale=float(ref.abs().max()))


def lean_logits(model, prompts: list[list[int]], continuation: torch.Tensor) -> list[torch.Tensor]:
    """Logits of the prefill, then of each one-token step feeding `continuation` [N, STEPS]."""
    device = model.lm_head.weight.device
    ids, mask = (t.to(device) for t in left_padded(prompts))
    width = ids.shape[1]
    lean = LeanDecoder(model)
    valid = torch.ones(len(prompts), width + STEPS, dtype=torch.bool, device=device)
    valid[:, :width] = mask.bool()
    lean.start(len(prompts), width + STEPS, valid)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = [lean.forward(ids, positions, 0)]
    for t in range(STEPS):
        out.append(lean.forward(continuation[:, t : t + 1], positions[:, -1:] + 1 + t, width + t))
    return out


def reference_logits(model, prompts: list[list[int]], continuation: torch.Tensor) -> list[torch.Tensor]:
    """The same logits from one forward per row over its unpadded prompt + continuation, no cache."""
    rows = []
    with torch.no_grad():
        for p, cont in zip(prompts, continuation.tolist()):
            logits = model(input_ids=torch.tensor([p + cont], device=model.lm_head.weight.device)).logits[0]
            rows.append(logits[len(p) - 1 :])
    return [torch.stack([r[t] for r in rows]) for t in range(STEPS + 1)]


def _exact_rms(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))


def _exact_norm_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _exact_rms(x, self)


@contextlib.contextmanager
def norms_in_float64(*models):
    """Every RMSNorm of `models` and of the lean forward computed in the input's float64, not float32."""
    norms = [m for model in models for m in model.modules() if hasattr(m, "variance_epsilon")]
    for m in norms:
        m.forward = types.MethodType(_exact_norm_forward, m)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lean_decoder, "_rms", _exact_rms)
        try:
            yield
        finally:
            for m in norms:
                del m.forward


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(families()))
def test_prefill_and_steps_equal_the_models_forward_float64(name, device):
    torch.manual_seed(0)
    model = families()[name].double().to(device).eval()
    assert unsupported_reason(model) is None
    continuation = torch.randint(0, 64, (len(PROMPTS), STEPS), device=device)
    with norms_in_float64(model):
        pairs = list(zip(lean_logits(model, PROMPTS, continuation), reference_logits(model, PROMPTS, continuation)))
    if device == "cpu":  # the forwards as they run: torch's CPU rms_norm is transformers' float32 norm
        pairs += zip(lean_logits(model, PROMPTS, continuation), reference_logits(model, PROMPTS, continuation))
    for t, (got, ref) in enumerate(pairs):
        torch.testing.assert_close(got, ref, rtol=0, atol=_tol(model, ref),
                                   msg=lambda m, t=t: f"{name} step {t % (STEPS + 1)}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["qwen2_gqa_bias_tied", "llama_mha_head_dim_untied"])
def test_bfloat16_error_no_larger_than_transformers_own(name, device):
    torch.manual_seed(1)
    model = families()[name].to(device).eval()
    continuation = torch.randint(0, 64, (len(PROMPTS), STEPS), device=device)
    exact = reference_logits(model.double(), PROMPTS, continuation)
    model.bfloat16()
    theirs = reference_logits(model, PROMPTS, continuation)
    ours = lean_logits(model, PROMPTS, continuation)
    for t in range(STEPS + 1):
        their_err = (theirs[t].double() - exact[t]).abs().max().item()
        our_err = (ours[t].double() - exact[t]).abs().max().item()
        ulp = exact[t].abs().max().item() * 2.0**-8  # one bf16 ulp at the logits' scale
        assert our_err <= 1.5 * their_err + ulp, (name, t, our_err, their_err)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_model(TinyModelSpec(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                          num_key_value_heads=2, init_std=0.5, seed=5),
                            str(tmp_path_factory.mktemp("lean")))


@pytest.mark.parametrize("device", DEVICES)
def test_engine_decodes_the_same_with_and_without_the_lean_forward(model_dir, device):
    sampling = SamplingConfig(n=3, temperature=1.0, top_p=0.9, max_tokens=10, seed=11)
    lean_engine = HFEngine(model_dir, dtype=torch.float64, device=device)
    own_engine = HFEngine(model_dir, dtype=torch.float64, device=device)
    assert lean_engine.lean is not None
    own_engine.lean = None  # transformers' forward with its DynamicCache
    lean_engine.stop_ids = own_engine.stop_ids = set()
    with norms_in_float64(lean_engine.model, own_engine.model):
        runs = [(lean_engine.generate(PROMPTS, sampling), own_engine.generate(PROMPTS, sampling))]
    if device == "cpu":
        runs.append((lean_engine.generate(PROMPTS, sampling), own_engine.generate(PROMPTS, sampling)))
    for a, b in runs:
        assert a.response_ids == b.response_ids
        for x, y in zip(a.response_logprobs, b.response_logprobs):
            tol = logprob_tol(lean_engine.model.config, max(map(len, PROMPTS)) + sampling.max_tokens,
                              dtype=torch.float64, value_scale=max(map(abs, y)))  # measured: <= 1/4 of it
            assert x == pytest.approx(y, abs=tol)


def test_weight_sync_reaches_the_fused_weights(model_dir):
    engine = HFEngine(model_dir, dtype=torch.float64)
    torch.manual_seed(2)
    new = {name: torch.randn_like(p) * 0.3 for name, p in engine.model.named_parameters()}
    engine.update_weights(new.items())
    layer = engine.lean.layers[0]
    attn = engine.model.model.layers[0].self_attn
    torch.testing.assert_close(layer.qkv_w, torch.cat([new[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]),
                               rtol=0, atol=0)
    continuation = torch.randint(0, engine.model.config.vocab_size, (len(PROMPTS), STEPS))
    fresh = Qwen2ForCausalLM(engine.model.config).double().eval()
    fresh.load_state_dict(new, strict=False)
    fresh.tie_weights()
    assert attn.q_proj.weight.data_ptr() == layer.qkv_w.data_ptr()  # still a view after the copy
    for got, ref in zip(lean_logits(engine.model, PROMPTS, continuation), reference_logits(fresh, PROMPTS, continuation)):
        torch.testing.assert_close(got, ref, rtol=0, atol=_tol(fresh, ref))


def test_models_it_cannot_reproduce_are_named_and_decode_with_their_own_forward(model_dir):
    sliding = Qwen2ForCausalLM(Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                           sliding_window=4, max_window_layers=0))
    assert "sliding-window" in unsupported_reason(sliding)
    dynamic = LlamaForCausalLM(LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                                           rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}))
    assert "depends on the sequence length" in unsupported_reason(dynamic)
    mlp_bias = LlamaForCausalLM(LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, mlp_bias=True))
    assert "MLP biases" in unsupported_reason(mlp_bias)
    with pytest.raises(ValueError, match="does not reproduce this model: .*sliding-window"):
        LeanDecoder(sliding)
    engine = HFEngine(model_dir, dtype=torch.float64)
    engine.model.config.model_type = "some_other_llm"  # what the engine checks at build time
    engine._build_lean()
    assert engine.lean is None
    greedy = SamplingConfig(n=1, temperature=0.0, max_tokens=6)
    engine.stop_ids = set()
    lean_engine = HFEngine(model_dir, dtype=torch.float64)
    lean_engine.stop_ids = set()
    assert engine.generate(PROMPTS, greedy).response_ids == lean_engine.generate(PROMPTS, greedy).response_ids
