"""Lean RMSNorm: HF's forward bit for bit, the analytic backward against autograd through HF's
arithmetic, what autograd keeps for backward, the swap over a whole decoder, and the config keys.

Tolerances (u = unit roundoff of the compute dtype: 2^-24 in fp32, 2^-53 in fp64). With y = x * r and
dz = grad * weight, dx_j = r * (dz_j - y_j * mean(dz * y)): both ways of computing it sum H products
(our mean, autograd's sum behind rsqrt's gradient), each sum off by at most (H - 1) u sum|dz * y|
(the standard recursive-summation bound), plus a few roundings of each element. So per element
|dx - dx_ref| <= 2 (H + 8) u * r * (|dz_j| + |y_j| * mean|dz * y|), and for dweight, a sum over N
tokens, |dw - dw_ref| <= 2 (N + 8) u * sum_tokens |grad * z|. In fp64 the reference is HF's
arithmetic with its fp32 upcast done in fp64 and the bound is 1e-12 times the same scale (rounding
is ~1e-14 of it; a wrong formula is off by O(1)). bf16 adds one bf16 rounding (2^-8) of each result,
and of each product grad * z that autograd rounds to bf16 before summing.
"""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError
from test_config import make as _config
from tolerances import assert_grads_close, model_rtol
from torch import nn
from transformers import Qwen2Config, Qwen2Model, Qwen3Config, Qwen3Model
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from rlsp.checks.resume_check import changed_settings
from rlsp.config.validate import validate_config
from rlsp.models.rms_norm import LeanRMSNorm, apply_lean_rmsnorm

H, SHAPE, EPS = 64, (3, 7), 1e-6  # hidden size, leading dims (21 tokens), epsilon


def _hf_norm(cls: type, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    norm = cls(H, eps=EPS)
    with torch.no_grad():  # a trained-looking weight, not all ones
        norm.weight.copy_(1 + 0.5 * torch.randn(H, generator=torch.Generator().manual_seed(seed)))
    return norm.to(dtype)


def _inputs(dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(*SHAPE, H, generator=g)).to(dtype)
    return x, torch.randn(*SHAPE, H, generator=g)


def _grads(norm: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    norm.weight.grad = None
    x = x.detach().requires_grad_(True)
    out = norm(x)
    out.backward(grad.to(out.dtype))
    return out.detach(), x.grad, norm.weight.grad


@pytest.mark.parametrize("cls", [LlamaRMSNorm, Qwen2RMSNorm])
@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
def test_forward_is_bit_identical_to_hf(cls, dtype, weight_dtype):
    hf = _hf_norm(cls, weight_dtype)
    lean = LeanRMSNorm(hf.weight, hf.variance_epsilon)
    x, _ = _inputs(dtype)
    with torch.no_grad():
        ours, theirs = lean(x), hf(x)
    assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


class _Fp64Arithmetic(nn.Module):
    """HF's RMSNorm lines with the upcast done to fp64 instead of fp32 (the fp64 reference)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float64)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + EPS)
        return self.weight * hidden_states.to(input_dtype)


def _bounds(x, weight, grad, u: float, scale: float):
    """The per-element bounds of the module docstring, from fp64 values."""
    x, w, g = x.double(), weight.detach().double(), grad.double()
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    y, dz = x * r, g * w
    dx_bound = scale * r * (dz.abs() + y.abs() * (dz * y).abs().mean(-1, keepdim=True))
    tokens = x.numel() // H
    dw_scale = (g * y).abs().reshape(-1, H).sum(0)
    return dx_bound * 2 * (H + 8) * u, dw_scale * 2 * (tokens + 8) * u, dw_scale


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gradients_match_autograd_through_hf(dtype):
    hf = _hf_norm(LlamaRMSNorm, dtype)
    ref = _Fp64Arithmetic(hf.weight) if dtype == torch.float64 else hf
    lean = LeanRMSNorm(hf.weight, EPS)
    x, grad = _inputs(dtype)
    grad = grad.to(dtype)
    out, dx, dw = _grads(lean, x, grad)
    out_ref, dx_ref, dw_ref = _grads(ref, x, grad)
    assert torch.equal(out, out_ref) and dx.dtype == dtype and dw.dtype == dtype
    u, scale = (2.0**-53, 1e-12 / (2 * (H + 8) * 2.0**-53)) if dtype == torch.float64 else (2.0**-24, 1.0)
    dx_bound, dw_bound, _ = _bounds(x, hf.weight, grad, u, scale)
    if dtype == torch.float64:
        dw_bound = dw_bound / (2 * (SHAPE[0] * SHAPE[1] + 8) * u) * 1e-12
    assert bool(((dx - dx_ref).double().abs() <= dx_bound).all()), float((dx - dx_ref).abs().max())
    assert bool(((dw - dw_ref).double().abs() <= dw_bound).all()), float((dw - dw_ref).abs().max())
    assert float(dx_ref.abs().max()) > 1e-3 and float(dw_ref.abs().max()) > 1e-1  # not vacuous


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_bf16_gradients_match_autograd_through_hf(weight_dtype):
    hf = _hf_norm(Qwen2RMSNorm, weight_dtype)
    lean = LeanRMSNorm(hf.weight, EPS)
    x, grad = _inputs(torch.bfloat16)
    out, dx, dw = _grads(lean, x, grad)
    out_ref, dx_ref, dw_ref = _grads(hf, x, grad)
    assert torch.equal(out, out_ref) and dx.dtype == torch.bfloat16 and dw.dtype == weight_dtype
    grad = grad.to(out.dtype)
    dx_bound, dw_bound, dw_scale = _bounds(x, hf.weight, grad, 2.0**-24, 1.0)
    bf16 = 2.0**-8  # one bf16 rounding of each result (and of each product grad * z on autograd's side)
    dx_bound = dx_bound + bf16 * dx_ref.double().abs() * 2
    dw_bound = dw_bound + bf16 * (dw_ref.double().abs() + dw_scale) * 2
    assert bool(((dx - dx_ref).double().abs() <= dx_bound).all()), float((dx - dx_ref).abs().max())
    assert bool(((dw - dw_ref).double().abs() <= dw_bound).all()), float((dw - dw_ref).abs().max())


def _saved_bytes(norm: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward during `norm(x)`."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        norm(x)
    return sum(storages.values())


@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.bfloat16, torch.float32)])
def test_autograd_keeps_the_input_and_one_fp32_number_per_token(dtype, weight_dtype):
    hf = _hf_norm(LlamaRMSNorm, weight_dtype)
    x = _inputs(dtype)[0].requires_grad_(True)
    tokens, w_bytes = x.numel() // H, hf.weight.numel() * hf.weight.element_size()
    lean_bytes = _saved_bytes(LeanRMSNorm(hf.weight, EPS), x)
    assert lean_bytes == x.numel() * x.element_size() + 4 * tokens + w_bytes
    # HF keeps the fp32 input (the input itself when it is fp32), the normalised value in the input
    # dtype, the fp32 inverse RMS and the weight
    hf_bytes = _saved_bytes(hf, x)
    assert hf_bytes == x.numel() * (4 + x.element_size()) + 4 * tokens + w_bytes
    assert hf_bytes > lean_bytes


def _qwen(cls_config, cls_model, dtype: torch.dtype, checkpointing: bool) -> nn.Module:
    config = cls_config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    model = cls_model(config).to(dtype).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


@pytest.mark.parametrize("arch,swapped", [("qwen2", 5), ("qwen3", 9)])  # 2 per layer + final; Qwen3: + q/k norms
@pytest.mark.parametrize("checkpointing", [False, True])
def test_decoder_swap_keeps_names_parameters_values_and_gradients(arch, swapped, checkpointing):
    classes = (Qwen2Config, Qwen2Model) if arch == "qwen2" else (Qwen3Config, Qwen3Model)
    plain = _qwen(*classes, torch.float32, checkpointing)
    lean = copy.deepcopy(plain)
    params = dict(lean.named_parameters())
    assert apply_lean_rmsnorm(lean) == swapped
    assert sum(isinstance(m, LeanRMSNorm) for m in lean.modules()) == swapped
    assert list(params) == [n for n, _ in lean.named_parameters()]
    assert all(params[n] is p for n, p in lean.named_parameters())  # the same Parameter objects
    ids = torch.randint(0, 50, (2, 11), generator=torch.Generator().manual_seed(2))
    outs = []
    for model in (plain, lean):
        out = model(input_ids=ids).last_hidden_state
        out.square().sum().backward()
        outs.append((out.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert torch.equal(outs[0][0], outs[1][0])
    # the backward differs (the analytic norm gradient sums in another order): tests/tolerances.py's bound
    # for this decoder's gradients over its 2 x 11 tokens (measured: 1/40 of it)
    rtol = model_rtol(plain.config, ids.numel())
    assert_grads_close(outs[1][1], outs[0][1], rtol)


def test_gemma_style_and_weightless_norms_are_refused():
    class Decoder(nn.Module):
        def __init__(self, norm: nn.Module) -> None:
            super().__init__()
            self.norm = norm

    gemma = Decoder(GemmaRMSNorm(H))
    with pytest.raises(ValueError, match=r"norm: GemmaRMSNorm is not weight \* \(x \* rsqrt.*lean_rmsnorm=false"):
        apply_lean_rmsnorm(gemma)
    with torch.no_grad():
        gemma.norm.weight.normal_()  # trained (1 + weight) scales are refused too
    with pytest.raises(ValueError, match="GemmaRMSNorm is not weight"):
        apply_lean_rmsnorm(gemma)
    assert isinstance(gemma.norm, GemmaRMSNorm)  # nothing swapped

    class WeightlessRMSNorm(nn.Module):
        variance_epsilon = EPS

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)

    with pytest.raises(ValueError, match=r"norm: WeightlessRMSNorm has tensors \[\].*set lean_rmsnorm=false"):
        apply_lean_rmsnorm(Decoder(WeightlessRMSNorm()))
    with pytest.raises(ValueError, match=r"Decoder has no RMSNorm modules \(its norms: \['LayerNorm'\]\)"):
        apply_lean_rmsnorm(Decoder(nn.LayerNorm(H)))
    model = _qwen(Qwen2Config, Qwen2Model, torch.float32, False)
    apply_lean_rmsnorm(model)
    with pytest.raises(ValueError, match="has no RMSNorm modules"):  # applied twice: nothing left to swap
        apply_lean_rmsnorm(model)


@pytest.mark.parametrize("prefix", ["actor_rollout_ref.model", "critic.model"])
def test_config_key_is_a_bool_and_combines_with_tensor_parallelism(prefix):
    tp_key = "actor_rollout_ref.actor" if prefix.startswith("actor") else "critic"
    cfg = _config(**{"algorithm.adv_estimator": "gae", f"{prefix}.lean_rmsnorm": True,
                     f"{tp_key}.tensor_model_parallel_size": 2, "trainer.n_gpus_per_node": 2})
    validate_config(cfg)
    assert OmegaConf.select(cfg, f"{prefix}.lean_rmsnorm") is True
    with pytest.raises(ValidationError, match="lean_rmsnorm"):  # the typed bool field refuses anything else
        OmegaConf.update(cfg, f"{prefix}.lean_rmsnorm", "sometimes")


def test_resume_treats_the_key_as_not_changing_the_model():
    saved = OmegaConf.to_container(_config(), resolve=True)
    cfg = _config(**{"actor_rollout_ref.model.lean_rmsnorm": True, "critic.model.lean_rmsnorm": True})
    assert changed_settings(cfg, saved) == []
    assert changed_settings(_config(**{"actor_rollout_ref.model.dtype": "bfloat16"}), saved)  # the check does see changes
