"""Per-token KL estimators between the policy and the reference policy.

All kinds take the log-probabilities of the sampled tokens under the policy (``logprobs``) and the
reference (``ref_logprobs``) and return a per-token estimate of KL(policy || reference).

Shape legend: "..." any shape shared by both inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlsp.config.choices import KL_ESTIMATOR_NAMES

# The k3 estimate is clamped: one token with a huge ratio would otherwise dominate the loss.
K3_CLAMP = 10.0
# Keeps exp() finite (and its gradient free of inf * 0) without changing the clamped k3 value.
MAX_LOG_RATIO = 20.0


def _k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return logprobs - ref_logprobs


def _abs(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return (logprobs - ref_logprobs).abs()


def _k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprobs - ref_logprobs).square()


def _k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    # ratio - log(ratio) - 1 with ratio = p_ref / p: unbiased for KL(p || ref) and never negative.
    log_ratio = (ref_logprobs - logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-K3_CLAMP, K3_CLAMP)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": _k1,
    "kl": _k1,
    "abs": _abs,
    "k2": _k2,
    "mse": _k2,
    "k3": _k3,
    "low_var_kl": _k3,
}
# The config validates both KL keys against these names: the table must implement exactly them.
assert tuple(KL_ESTIMATORS) == KL_ESTIMATOR_NAMES, f"{tuple(KL_ESTIMATORS)} != {KL_ESTIMATOR_NAMES}"


def compute_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of ``kind``:

    "k1"/"kl": lp - ref;  "abs": |lp - ref|;  "k2"/"mse": 0.5 * (lp - ref)^2;
    "k3"/"low_var_kl": exp(ref - lp) - (ref - lp) - 1, clamped to [-10, 10].
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL kind {kind!r}; legal kinds: {', '.join(KL_ESTIMATORS)}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs shape {tuple(logprobs.shape)} != ref_logprobs shape {tuple(ref_logprobs.shape)}")
    return KL_ESTIMATORS[kind](logprobs, ref_logprobs)
