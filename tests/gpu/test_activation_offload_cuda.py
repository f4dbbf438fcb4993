"""Activation offload on CUDA: side-stream copies to pinned host memory, prefetch one layer ahead.

Checks that the gradients are bit-identical to a run without offload (the copies are exact; any
missing stream ordering would show up as wrong values), that between forward and backward the
saved layer inputs really are off the device (allocated bytes drop by at least the layers' inputs)
and sit in pinned host memory, and that backward brought all but the first group back ahead of use.
Skipped without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlsp.engine.offload import offload_saved_tensors
from rlsp.engine.offload_queue import CudaCopies, OffloadQueue, OffloadStats

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
S, H, LAYERS = 4096, 512, 6


def _model() -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=512, hidden_size=H, intermediate_size=1024, num_hidden_layers=LAYERS,
                         num_attention_heads=8, num_key_value_heads=4)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).cuda()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _loss(model: Qwen2ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).mean()


def _allocated() -> int:
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")  # lets the allocator retire blocks whose side-stream use has ended
    return torch.cuda.memory_allocated()


def _step(model: Qwen2ForCausalLM, ids: torch.Tensor, offload: bool) -> tuple[dict[str, torch.Tensor], int, OffloadStats]:
    model.zero_grad(set_to_none=True)
    stats = OffloadStats()
    before = _allocated()
    if offload:
        with offload_saved_tensors(model, torch.device("cuda"), stats):
            loss = _loss(model, ids)
    else:
        loss = _loss(model, ids)
    held = _allocated() - before  # what the forward leaves on the device for backward
    loss.backward()
    torch.cuda.synchronize()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, held, stats


def test_offloaded_gradients_are_bit_identical_and_inputs_leave_the_device():
    model = _model()
    ids = torch.randint(0, 512, (1, S), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    reference, held_plain, _ = _step(model, ids, offload=False)
    grads, held_offload, stats = _step(model, ids, offload=True)
    for name in reference:
        assert torch.equal(grads[name], reference[name]), name
    layer_inputs = LAYERS * S * H * 4
    assert held_plain - held_offload >= layer_inputs, (held_plain, held_offload)
    assert stats.bytes >= layer_inputs
    assert stats.prefetched_bytes >= (LAYERS - 1) * S * H * 4  # every layer but the last came back early
    assert stats.prefetched_bytes + stats.on_demand_bytes == stats.bytes


def test_queue_copies_through_pinned_host_memory_exactly():
    stats = OffloadStats()
    queue = OffloadQueue(CudaCopies(torch.device("cuda")), stats)
    src = [torch.randn(1024, 1024, device="cuda"), torch.randint(0, 9, (4096,), device="cuda")]
    expected = [t.clone() for t in src]
    for t in src:
        queue.new_group()
        queue.put(t)
    del src  # the allocator may reuse the memory only after the side-stream copy read it
    scratch = [torch.full((1024, 1024), 7.0, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()
    assert all(e.host.device.type == "cpu" and e.host.is_pinned() for e in queue.entries)
    assert torch.equal(queue.take(1).cpu(), expected[1].cpu())  # prefetches group 1 (tensor 0)
    assert torch.equal(queue.take(0), expected[0])
    assert (stats.prefetched, stats.on_demand) == (1, 1) and len(scratch) == 4
