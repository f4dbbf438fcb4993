"""Tensor parallelism is exact for the windowed / soft-capped / sink families: Gemma 2, Gemma 3 (text), gpt-oss.

The tiny models of tests/distributed/test_gemma_exact.py (tests/tiny_gemma.py, tests/tiny_gpt_oss.py: sliding and
full layers, window 4, 6 q / 2 kv heads, so a tp rank holds 3 q / 1 kv heads; Gemma 2 with attention and
final-logit soft-capping, Gemma 3 with per-head q/k norms, gpt-oss with attention sinks sharded over tp like the q
heads and 4 experts replicated over tp) go through the FSDP2 policy engine at tp 2, with and without
sequence-parallel activations, and at tp 2 x Ulysses 2 on 4 ranks: the loss metrics, every parameter's full
gradient and the AdamW step equal one process's within tests/tolerances.py's bounds for the model
(tests/distributed/test_fsdp_engine.py's `_assert_same_step`). Other mixture-of-experts families stay refused
under tp by name (`check_tp_support`; the MoE families rlsp runs under tp: test_tp_moe_exact.py).
"""

from __future__ import annotations

import pytest
from _launch import run_distributed
from test_fsdp_engine import B, _assert_same_step, _rollout_batch, _train_once
from test_gemma_exact import EXACT_FAMILIES, _write_tiny


@pytest.fixture(scope="module")
def tp_model_and_batch(request, tmp_path_factory):
    """(tiny model path, rollout batch, one process's step) of the family `request.param`."""
    from transformers import AutoConfig

    path = _write_tiny(request.param, str(tmp_path_factory.mktemp(f"tp_{request.param}")))
    batch = _rollout_batch(AutoConfig.from_pretrained(path).vocab_size)
    reference = run_distributed(_train_once, 1, path, 1, B, batch)[0]
    return path, batch, reference


@pytest.mark.distributed
@pytest.mark.parametrize("tp_model_and_batch", EXACT_FAMILIES, indirect=True)
@pytest.mark.parametrize("seq_par,micro", [(True, 3), (False, B)], ids=["seqpar", "no_seqpar"])
def test_tp2_keeps_window_family_loss_gradients_and_step_exact(tp_model_and_batch, seq_par, micro):
    path, batch, reference = tp_model_and_batch
    got = run_distributed(_train_once, 2, path, 1, micro, batch, None, -1, 1, 2, seq_par)[0]
    _assert_same_step(got, reference, path)


@pytest.mark.distributed
@pytest.mark.parametrize("tp_model_and_batch", ["gpt_oss"], indirect=True)
def test_tp2_x_ulysses2_keeps_gpt_oss_exact(tp_model_and_batch):
    """4 ranks: Ulysses 2 over tp 2 (a rank attends 3 // 2 -> 2 or 1 of its tp rank's 3 q heads with their sinks)."""
    path, batch, reference = tp_model_and_batch
    got = run_distributed(_train_once, 4, path, 2, 3, batch, None, -1, 1, 2, True)[0]
    _assert_same_step(got, reference, path)


def test_check_tp_support_accepts_the_window_families_and_refuses_other_moe_by_name() -> None:
    from tiny_gemma import FAMILIES, gemma_config
    from tiny_gpt_oss import gpt_oss_config
    from transformers import PhimoeConfig

    from rlsp.models.family_checks import check_tp_windowed
    from rlsp.parallel.tp_checks import check_tp_support

    for config in (*(gemma_config(f) for f in FAMILIES), gpt_oss_config()):
        check_tp_windowed(config, 2)
        check_tp_support(config, 2)
    phimoe = PhimoeConfig(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, num_local_experts=4)
    check_tp_support(phimoe, 1)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=2: phimoe has mixture-of-experts layers "
                                         r"\(num_local_experts=4\).*\['gpt_oss', .*'glm4_moe', .*\] only.*legal: 1"):
        check_tp_support(phimoe, 2)
