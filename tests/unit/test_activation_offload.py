"""Activation offload: the saved-tensor hooks copy activations (not parameters) out and back bit for bit;
on CPU the engine option is a no-op that says so once; the config keys are validated.

The hook pair is exercised on CPU with device=cpu (copies into fresh host buffers, the same code path
as the device-to-pinned-host copy on CUDA); the reference is the same checkpointed model without hooks.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from omegaconf import OmegaConf
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlsp.config.schema import RLSPConfig
from rlsp.config.validate import validate_config
from rlsp.engine.offload import ActivationOffload, OffloadStats, offload_saved_tensors

S, H, LAYERS = 11, 32, 3


def _model() -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=40, hidden_size=H, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _grads(model: Qwen2ForCausalLM, ids: torch.Tensor, offload: torch.device | None) -> tuple[dict[str, torch.Tensor], OffloadStats]:
    model.zero_grad(set_to_none=True)
    stats = OffloadStats()
    context = offload_saved_tensors(model, offload, stats) if offload is not None else contextlib.nullcontext()
    with context:
        loss = model(input_ids=ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).mean()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, stats


def _saved(model: Qwen2ForCausalLM, ids: torch.Tensor) -> list[torch.Tensor]:
    """Every tensor the forward saves for backward (recorded by a plain hook pair)."""
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        model(input_ids=ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).mean()
    return saved


# cpu:0 names an index the tensors' device (cpu) does not, as an engine's `cuda` does against `cuda:0`
@pytest.mark.parametrize("device", [torch.device("cpu"), torch.device("cpu", 0)], ids=str)
def test_offloaded_activations_come_back_bit_for_bit_and_parameters_stay(device):
    model = _model()
    ids = torch.randint(0, 40, (1, S), generator=torch.Generator().manual_seed(1))
    reference, _ = _grads(model, ids, offload=None)
    grads, stats = _grads(model, ids, offload=device)
    assert grads.keys() == reference.keys()
    for name in grads:  # copies out and back: bit-identical gradients
        assert torch.equal(grads[name], reference[name]), name
    # what autograd saves, classified independently: parameters stay, everything else is copied out
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = _saved(model, ids)
    offloaded = [t for t in saved if t.untyped_storage().data_ptr() not in params]
    assert sum(t.shape == (1, S, H) for t in offloaded) >= LAYERS  # the checkpointed layers' inputs
    assert stats.tensors == len(offloaded) and stats.kept == len(saved) - len(offloaded) >= 2  # norm, lm_head
    assert stats.bytes == sum(t.numel() * t.element_size() for t in offloaded) >= LAYERS * S * H * 4


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_engine_option_on_cpu_is_a_logged_no_op():
    handler = _Records()
    logger = logging.getLogger("rlsp.engine.offload")
    logger.addHandler(handler)
    try:
        model = _model()
        offload = ActivationOffload(True, model, torch.device("cpu"))
        for _ in range(3):  # micro-batches
            with offload() as stats:
                model(input_ids=torch.ones(1, S, dtype=torch.long))
        assert not offload.active and stats.tensors == 0
        assert ActivationOffload(False, model, torch.device("cuda")).active is False
        assert ActivationOffload(True, model, torch.device("cuda")).active is True
    finally:
        logger.removeHandler(handler)
    assert handler.lines == ["activation offload (enable_activation_offload=true) has no effect on cpu: saved activations "
                     "already live in host memory"]


@pytest.mark.parametrize("prefix", ["actor_rollout_ref.model", "critic.model"])
def test_offload_without_checkpointing_is_refused_with_the_reason(prefix):
    cfg = OmegaConf.structured(RLSPConfig)
    OmegaConf.update(cfg, "algorithm.adv_estimator", "gae")
    OmegaConf.update(cfg, f"{prefix}.enable_activation_offload", True)
    OmegaConf.update(cfg, f"{prefix}.enable_gradient_checkpointing", False)  # auto would turn it on
    with pytest.raises(ValueError) as err:
        validate_config(cfg)
    msg = str(err.value)
    assert f"{prefix}.enable_activation_offload=true needs {prefix}.enable_gradient_checkpointing=true" in msg
    assert "legal: enable both, or neither" in msg
    OmegaConf.update(cfg, f"{prefix}.enable_gradient_checkpointing", True)
    validate_config(cfg)
