"""vLLM (CPU, in-process) takes an in-place weight sync of a mixture-of-experts model exactly (tiny qwen3_moe, the
family verl's scripts train).

The trainer sends transformers' in-memory names (`experts.gate_up_proj` [E, 2I, H], fused); `update_weights` turns
them into per-expert checkpoint names (rlsp/rollout/moe_names.py) and, on CPU, prepacks the reloaded experts that
vLLM 0.32's reload leaves unpacked. Measured before the fix (tiny models, 0.05 perturbations): every sync, even an
attention-only or router-only one, left the CPU experts unpacked (qwen3_moe gaps 2.7-4.4, olmoe 2.8-4.2, mixtral
5.3-5.7 once named right; mixtral's loader refused the fused names outright). After it, vLLM's prompt logprobs equal
transformers' forward of the perturbed model, every position, within tests/tolerances.py's logprob_tol (measured
1.7e-6 to 2.7e-6 against a bound of 3.5e-5). The names alone are checked exactly in tests/unit/test_moe_names.py (this
family's vLLM loader takes the fused names too).
"""

from __future__ import annotations

import time

import pytest
import torch
from tiny_moe import write_tiny_moe
from tolerances import logprob_tol
from transformers import AutoModelForCausalLM

from rlsp.rollout import build_rollout_engine

pytestmark = pytest.mark.e2e
IDS = list(range(5, 30))


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("vllm")
    path = write_tiny_moe("qwen3_moe", str(tmp_path_factory.mktemp("moe") / "qwen3_moe"))
    t0 = time.perf_counter()
    engine = build_rollout_engine("vllm", path, dtype="float32", max_model_len=64, seed=0)
    print(f"\nvLLM engine build: {time.perf_counter() - t0:.1f}s")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return engine, model, logprob_tol(model.config, len(IDS))


def _reference(model) -> torch.Tensor:
    with torch.no_grad():
        logp_TV = model(input_ids=torch.tensor([IDS])).logits[0].double().log_softmax(-1)
    return logp_TV[:-1].gather(-1, torch.tensor(IDS[1:])[:, None])[:, 0]


def _engine_logprobs(engine) -> torch.Tensor:
    return torch.tensor(engine.prompt_logprobs(IDS)[1:], dtype=torch.float64)


def _perturb_and_sync(engine, model, picked, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Perturb the parameters `picked` selects, sync every parameter as the trainer sends it (FSDPEngine
    .iter_full_params: named_parameters(), fused experts), and return (logprobs before, after the change)."""
    old = _reference(model)
    gen = torch.Generator().manual_seed(seed)
    names = [name for name, _ in model.named_parameters() if picked(name)]
    assert names
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in names:
                param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    engine.update_weights((name, p.detach().clone()) for name, p in model.named_parameters())
    return old, _reference(model)


def test_engine_matches_transformers_at_load(setup) -> None:
    engine, model, tol = setup
    gap = float((_engine_logprobs(engine) - _reference(model)).abs().max())
    assert gap <= tol, (gap, tol)


@pytest.mark.parametrize("part", ["experts", "router_and_attention"])
def test_sync_reaches_vllm(setup, part: str) -> None:
    engine, model, tol = setup
    picked = {"experts": lambda n: ".mlp.experts." in n,
              "router_and_attention": lambda n: n.endswith("mlp.gate.weight") or ".self_attn." in n}[part]
    old, new = _perturb_and_sync(engine, model, picked, seed=len(part))
    assert float((new - old).abs().max()) > 0.05  # the change is visible: the check below has teeth
    got = _engine_logprobs(engine)
    gap = (got - new).abs()
    print(f"\n{part}-only sync: max |vLLM - transformers| {float(gap.max()):.2e} (bound {tol:.2e})")
    assert bool((gap <= tol).all()), (gap.tolist(), tol)
