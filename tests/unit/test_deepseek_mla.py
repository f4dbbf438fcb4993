"""Multi-latent attention (DeepSeek-V3 with and without q_lora_rank, DeepSeek-V2) in rlsp's packed forward.

- A tiny model (tests/tiny_deepseek.py: q/k head dim 10, v head dim 6, yarn mscale in the scale, dense + routed MoE
  layers) through rlsp_ulysses on one rank gives transformers' eager forward's logits, every element, for each row
  of a packed stream (segments of different lengths: the padded SDPA path and the per-segment one).
- The Ulysses all-to-all carries v with its own head dim: on a single-rank group (sp=1 code path) the shapes
  pass through; the multi-rank exchange is tested in tests/distributed/test_deepseek_exact.py.
- The checks accept deepseek_v2/v3 for Ulysses, ring and tensor parallelism (at the tp sizes that divide the heads:
  tests/unit/test_tp_mla_support.py), refuse vLLM on CPU by name, and keep refusing other multi-latent families.
Bounds: tests/tolerances.py (fp32: the router and the grouped expert matmuls compute in fp32).
"""

from __future__ import annotations

import pytest
import torch
from tiny_deepseek import HEADS, VARIANTS, deepseek_config
from tolerances import assert_tensor_close, model_rtol
from transformers import AutoModelForCausalLM, PretrainedConfig

from rlsp.data.packing import pack_sequences
from rlsp.models.family_checks import check_ring_support, check_sp_support
from rlsp.models.loading import build_causal_lm_from_config
from rlsp.parallel.tp_checks import check_tp_support
from rlsp.parallel.ulysses import build_sp_context
from rlsp.rollout.support import check_rollout_support

LENS = (7, 13, 3, 1, 10)
VOCAB = 50


def _packed_forward(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    packed = pack_sequences(ids, mask)
    ctx = build_sp_context(None, packed, HEADS, HEADS)
    with torch.no_grad():
        return model(input_ids=packed.input_ids.view(1, -1), position_ids=packed.position_ids.view(1, -1),
                     sp_context=ctx).logits[0, :int(mask.sum())]


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_deepseek_logits_equal_transformers_eager(variant) -> None:
    config = deepseek_config(variant, vocab=VOCAB)
    torch.manual_seed(0)
    model = build_causal_lm_from_config(config, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    ref.load_state_dict(model.state_dict())
    attn = ref.model.layers[0].self_attn
    assert attn.scaling != attn.qk_head_dim ** -0.5  # the yarn mscale is folded into transformers' scaling kwarg
    width = max(LENS)
    ids = torch.randint(1, VOCAB, (len(LENS), width), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(width)[None, :] < torch.tensor(LENS)[:, None]).long()
    got = _packed_forward(model, ids, mask)
    with torch.no_grad():
        rows = torch.cat([ref(input_ids=ids[b:b + 1, :n]).logits[0] for b, n in enumerate(LENS)])
    assert_tensor_close(got, rows, model_rtol(config, sum(LENS), backward=False))
    # the segments matter: the same tokens as one sequence give other logits
    joined = _packed_forward(model, ids[mask.bool()].view(1, -1), torch.ones(1, sum(LENS), dtype=torch.long))
    assert float((joined - rows).abs().max()) > 1e-2


def _mla_config(model_type: str) -> PretrainedConfig:
    config = deepseek_config("v3")
    config.model_type = model_type  # another family with kv_lora_rank (e.g. kimi_linear, minicpm3): not verified
    return config


def test_checks_accept_ulysses_ring_and_tp_and_refuse_vllm_cpu_by_name() -> None:
    for variant in VARIANTS:
        config = deepseek_config(variant)
        for sp in (1, 2, 4, 8):
            check_sp_support(config, sp)
        for ring in (1, 2, 4):  # ring carries v's own head dim (tests/unit/test_ring_mla.py)
            check_ring_support(config, ring)
        for tp in (1, 2, 3, 6):  # the heads split over tp (rlsp.parallel.tp_latent)
            check_tp_support(config, tp)
        error = check_rollout_support(config, "vllm", "cpu")
        assert error is not None and config.model_type in error and "rollout.name=hf" in error, error
        assert check_rollout_support(config, "hf", "cpu") is None
    with pytest.raises(ValueError, match=r"minicpm3: kv_lora_rank=10: multi-latent attention .* deepseek_v2 and "
                                         r"deepseek_v3 only"):
        check_sp_support(_mla_config("minicpm3"), 1)
