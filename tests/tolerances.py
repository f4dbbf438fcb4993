"""Bounds for comparing two computations of the same numbers: a parallel layout against one rank, a resumed
run against a continued one, a fused kernel against the plain one. Every test that compares an optimizer
step, a gradient or a logprob computed two ways takes its bound from here, never a fixed constant.

Derivation (u is the dtype's unit roundoff: 2^-24 in fp32, 2^-8 in bf16, 2^-53 in fp64):

1. Reductions in another order. A sum of n terms carries a rounding error of at most (n-1) u sum|x_i|
   (Higham, "Accuracy and Stability of Numerical Algorithms", 4.2); the errors of the individual additions
   have zero mean and are independent enough that the error grows as sqrt(n) u sum|x_i| (Higham & Mary,
   "A new approach to probabilistic rounding error analysis", 2019). Two layouts differ in the order of
   their sums (tokens split over ranks and micro-batches, heads over ranks, blocks merged by log-sum-exp),
   so their results differ by about that much twice. A network chains such reductions: each layer's
   projections, attention scores and weighted values, the MLP, the vocabulary's log-sum-exp, and the same
   again backwards; the relative errors of chained stages add. `roundoff_rtol` is that sum, times TWO for
   the two computations that each carry their own error (small random models are well conditioned: their
   logits are O(1), so no conditioning factor is added). Adding the stages rather than their squares keeps
   room for what that leaves out: a gradient that is a small sum of larger terms (mixed-sign advantages, a
   sequence-level ratio) carries the terms' roundoff. Measured on the tiny models of tests/distributed:
   gradients differ by 1/20 to 1/200 of this bound, loss metrics by less.
   A layout bug (a token, head or gradient shard lost or counted twice) moves a result by O(1e-2) or more,
   orders of magnitude above these bounds, so they keep the tests' power.

2. AdamW's first step. With m_hat = g and v_hat = g^2 the step moves a parameter by lr * f(g),
   f(g) = g / (|g| + eps), after the decay p * (1 - lr * wd) that both computations share. f is monotone
   with |f'(x)| = eps / (|x| + eps)^2, largest at the x of [g_ref, g] nearest 0 (0 itself when the signs
   differ), so two gradients that agree to fp32 roundoff give steps that differ by at most
   lr * |g - g_ref| * eps / (nearest + eps)^2: an element within ~eps = 1e-8 of 0 amplifies its roundoff by
   up to lr / eps (1e5 at lr 1e-3). Which element sits there, and how its roundoff falls, depends on the
   CPU's summation kernels: this is why a fixed tolerance on a step passes on one machine and fails on
   another. The step's own rounding adds a few units in the last place of |p| and of the update (lr).
   `adam_step_bound` returns that bound per element from the gradients both computations actually used;
   `assert_adam_step_close` checks every element of every parameter against it.
   A later step from a shared state (a resumed run against the continued one: the same m, v and step
   count, only this step's gradients differ) moves p by lr * m_hat / (sqrt(v_hat) + eps), whose slope in g
   is no longer small away from 0; `adam_step_bound(..., state=)` then evaluates that update in fp64 for
   both gradients and takes the difference exactly, adding the same few ulps of the step's own rounding.
   Runs that differ over several steps compare what each step did (its gradients, its metrics), not the
   weights after them.

3. bf16. Rounding a value to bf16 moves it by up to u_bf16 |x| = 2^-8 |x|; a bf16 computation compared with
   fp32 uses `roundoff_rtol(..., dtype=torch.bfloat16)`.

4. Two kernels, one model. vLLM's forward against the trainer's, a tensor-parallel engine against one
   process, a KV-cached decode against one full forward, a pooling engine against HF's head: the kernels
   differ in how they associate the same sums (online softmax over key blocks, fused norms, split matmuls,
   a log-sum-exp over vocabulary shards), never in what they sum, so each stage of a forward carries its own
   reordering error and `model_rtol(..., backward=False)` bounds the pair. A logprob x_t - lse(x) carries
   it at the scale of what the log-sum-exp sums to, log(vocab) for logits of O(1), or of the logprob
   itself where that is larger: `logprob_tol`. A later step's gap (after a weight sync) is the same bound:
   each side recomputes from the same synced weights. A wrong or missing weight sync, a wrong shard or a
   stale cache moves a logprob by O(0.1-1), far above it. `model_rtol` takes every stage at the longest
   reduction; for a deep model with a large vocabulary (SmolLM2-135M: 30 layers, 49152 entries) that
   leaves ~3e-2 on a logprob, too near a bug's size, so `logprob_tol(..., per_stage=True)` gives each stage
   its own length instead (derivation 1 as it stands): per layer the projections (hidden), the scores
   (head_dim), the weighted values (tokens) and the MLP (intermediate), then the vocabulary's log-sum-exp.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import SimpleNamespace

import torch

TWO = 2.0  # both computations carry their own rounding error
ADAM_EPS = 1e-8  # torch.optim.AdamW's default, which rlsp's optimizer keeps
STEP_ULPS = 4  # rounding of the decay, the division and the update inside one AdamW step


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """u: half the distance from 1 to the next representable number."""
    return torch.finfo(dtype).eps / 2


def roundoff_rtol(*, reduction: int, stages: int, dtype: torch.dtype = torch.float32) -> float:
    """Relative difference two evaluations may show that differ only in the order of `stages` chained
    reductions of at most `reduction` terms each (derivation 1)."""
    if reduction < 1 or stages < 1:
        raise ValueError(f"reduction={reduction} and stages={stages} must be >= 1")
    return TWO * stages * math.sqrt(reduction) * unit_roundoff(dtype)


def decoder_chain(config):
    """What a bound is taken over: the decoder `config` itself, or for a vision-language model its vision tower's
    blocks followed by its text layers (a token's logprob and a gradient pass through both)."""
    text, vision = getattr(config, "text_config", None), getattr(config, "vision_config", None)
    if text is None or vision is None:
        return config
    return SimpleNamespace(hidden_size=max(text.hidden_size, vision.hidden_size), vocab_size=text.vocab_size,
                           intermediate_size=max(text.intermediate_size, vision.intermediate_size),
                           num_hidden_layers=text.num_hidden_layers + vision.depth)


def model_rtol(config, tokens: int, *, backward: bool = True, dtype: torch.dtype = torch.float32) -> float:
    """`roundoff_rtol` for a decoder given by its HF `config` over `tokens` packed tokens: four reduction
    stages per layer (projections, scores, weighted values, MLP) plus the head's, doubled when the
    backward pass (gradients) is compared; the longest reduction is over the width, the tokens (attention;
    a weight gradient sums over all tokens) or the vocabulary. A vision-language config: `decoder_chain`."""
    config = decoder_chain(config)
    width = max(config.hidden_size, getattr(config, "intermediate_size", 0) or 0)
    reduction = max(width, tokens, config.vocab_size)
    stages = (4 * config.num_hidden_layers + 1) * (2 if backward else 1)
    return roundoff_rtol(reduction=reduction, stages=stages, dtype=dtype)


def scalar_tol(value_scale: float, rtol: float) -> float:
    """Absolute bound for a scalar (a loss metric, a mean logprob) whose summed terms are of size
    `value_scale`: a loss near 0 from cancelling terms still carries the terms' roundoff."""
    return rtol * max(abs(value_scale), 1.0)


def adam_step_bound(g: torch.Tensor, g_ref: torch.Tensor, p_ref: torch.Tensor, lr: float,
                    eps: float = ADAM_EPS, *, state: Mapping | None = None,
                    betas: tuple[float, float] = (0.9, 0.999)) -> torch.Tensor:
    """Per element, the largest difference AdamW's step (no clipping) can leave between two copies of a
    parameter whose gradients were g and g_ref (derivation 2): the first step, or with `state` (the
    shared `exp_avg`, `exp_avg_sq` and `step` count before it, as torch keeps them) a later one."""
    g, g_ref = g.double(), g_ref.double()
    ulp = torch.finfo(p_ref.dtype).eps
    if state is None:
        nearest = torch.where(g.sign() == g_ref.sign(), torch.minimum(g.abs(), g_ref.abs()), 0.0)
        amplified = lr * (g - g_ref).abs() * eps / (nearest + eps) ** 2
        return amplified + STEP_ULPS * ulp * (p_ref.double().abs() + lr)
    (b1, b2), t = betas, int(state["step"]) + 1
    m, v = state["exp_avg"].double(), state["exp_avg_sq"].double()

    def update(grad: torch.Tensor) -> torch.Tensor:
        m_hat = (b1 * m + (1 - b1) * grad) / (1 - b1**t)
        v_hat = (b2 * v + (1 - b2) * grad * grad) / (1 - b2**t)
        return lr * m_hat / (v_hat.sqrt() + eps)

    u, u_ref = update(g), update(g_ref)
    return (u - u_ref).abs() + STEP_ULPS * ulp * (p_ref.double().abs() + u_ref.abs() + lr)


def assert_adam_step_close(params: Mapping[str, torch.Tensor], ref_params: Mapping[str, torch.Tensor],
                           grads: Mapping[str, torch.Tensor], ref_grads: Mapping[str, torch.Tensor], lr: float,
                           eps: float = ADAM_EPS, states: Mapping[str, Mapping] | None = None) -> None:
    """Every element of every trained parameter (those with a gradient) after one AdamW step within
    `adam_step_bound` of the reference's (`states`: per name, the shared state before a later step); the
    message names the worst element's parameter, difference and bound."""
    assert grads.keys() == ref_grads.keys() and len(grads) > 0, (sorted(grads), sorted(ref_grads))
    assert params.keys() == ref_params.keys() and grads.keys() <= params.keys(), (sorted(params), sorted(grads))
    worst = (0.0, "", 0.0, 0.0)
    for name in grads:
        ref = ref_params[name]
        state = None if states is None else states[name]
        bound = adam_step_bound(grads[name], ref_grads[name], ref, lr, eps, state=state)
        err = (params[name].double() - ref.double()).abs()
        ratio = err / bound
        i = int(ratio.argmax())
        if ratio.flatten()[i] > worst[0]:
            worst = (float(ratio.flatten()[i]), name, float(err.flatten()[i]), float(bound.flatten()[i]))
    assert worst[0] <= 1.0, (f"AdamW step differs at {worst[1]}: {worst[2]:.3g} > bound {worst[3]:.3g} "
                             f"(ratio {worst[0]:.3g})")


def assert_grads_close(grads: Mapping[str, torch.Tensor], ref_grads: Mapping[str, torch.Tensor], rtol: float) -> None:
    """The same parameters, each gradient within `rtol` of the reference's in `rel_error`."""
    assert grads.keys() == ref_grads.keys() and len(grads) > 0, (sorted(grads), sorted(ref_grads))
    name, worst = max(((k, rel_error(grads[k], ref_grads[k])) for k in grads), key=lambda kv: kv[1])
    assert worst <= rtol, f"gradient of {name} differs by {worst:.3g} (relative) > {rtol:.3g}"


def assert_scalars_close(got: Mapping[str, float], ref: Mapping[str, float], keys, rtol: float,
                         value_scale: float = 1.0) -> None:
    """Each metric in `keys` within `scalar_tol(max(|reference|, value_scale), rtol)` of the reference's."""
    for key in keys:
        tol = scalar_tol(max(abs(ref[key]), value_scale), rtol)
        assert abs(got[key] - ref[key]) <= tol, (key, got[key], ref[key], tol)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm of the difference over the reference's norm (the gradients' measure)."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def assert_tensor_close(got: torch.Tensor, ref: torch.Tensor, rtol: float, value_scale: float | None = None) -> None:
    """Every element (logprobs, values, scores) within `scalar_tol(value_scale, rtol)` of the reference's;
    the scale defaults to the reference's largest magnitude."""
    scale = float(ref.double().abs().max()) if value_scale is None else value_scale
    err, tol = float((got.double() - ref.double()).abs().max()), scalar_tol(scale, rtol)
    assert got.shape == ref.shape and err <= tol, (tuple(got.shape), tuple(ref.shape), err, tol)


def forward_stages_rtol(config, tokens: int, *, dtype: torch.dtype = torch.float32) -> float:
    """Derivation 1 for a decoder's forward with each stage at its own reduction length (derivation 4)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    intermediate = getattr(config, "intermediate_size", 0) or hidden
    per_layer = sum(math.sqrt(n) for n in (hidden, head_dim, max(tokens, 1), intermediate))
    return TWO * (layers * per_layer + math.sqrt(config.vocab_size)) * unit_roundoff(dtype)


def logprob_tol(config, tokens: int, *, dtype: torch.dtype = torch.float32, value_scale: float = 0.0,
                per_stage: bool = False) -> float:
    """Absolute bound on a token's logprob (or a value head's output) computed by two forward kernels of the
    decoder given by its HF `config` over `tokens` tokens (derivation 4): `model_rtol` of the forward
    (`forward_stages_rtol` with `per_stage`) at the scale of log(vocab), or `value_scale` where larger."""
    rtol = (forward_stages_rtol(config, tokens, dtype=dtype) if per_stage
            else model_rtol(config, tokens, backward=False, dtype=dtype))
    return scalar_tol(max(math.log(config.vocab_size), abs(value_scale)), rtol)
