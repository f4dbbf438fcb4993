"""The activation-offload copy schedule: each checkpointed layer's saved tensors come back one layer ahead.

Run on CPU through the host copy strategy (same schedule as the CUDA side streams). The reference
for the schedule is derived independently of the queue: the layer boundaries are read from forward
pre-hooks on the decoder layers, the order backward needs the tensors from a plain recording hook
pair; gradients are compared bit for bit with a run without offload.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlsp.engine.offload import offload_saved_tensors
from rlsp.engine.offload_queue import HostCopies, OffloadQueue, OffloadStats

S, H, LAYERS = 9, 32, 4


def _model() -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=40, hidden_size=H, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _loss(model: Qwen2ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).mean()


def _run(model: Qwen2ForCausalLM, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], OffloadStats, list]:
    model.zero_grad(set_to_none=True)
    stats, log = OffloadStats(), []
    with offload_saved_tensors(model, torch.device("cpu"), stats, log):
        loss = _loss(model, ids)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, stats, log


def _independent_groups(model: Qwen2ForCausalLM, ids: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    """(group of each offloaded tensor in forward order, forward indices in the order backward unpacks
    them, bytes of each), recorded with plain hooks: a layer pre-hook counts boundaries, parameters are left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    group, groups, order, nbytes = [0], [], [], []
    handles = [layer.register_forward_pre_hook(lambda m, a: group.__setitem__(0, group[0] + 1))
               for layer in model.model.layers]

    def pack(t: torch.Tensor) -> tuple[int | None, torch.Tensor]:
        if t.untyped_storage().data_ptr() in params:
            return None, t
        groups.append(group[0])
        nbytes.append(t.numel() * t.element_size())
        return len(groups) - 1, t

    def unpack(packed: tuple[int | None, torch.Tensor]) -> torch.Tensor:
        if packed[0] is not None:
            order.append(packed[0])
        return packed[1]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = _loss(model, ids)
    for handle in handles:
        handle.remove()
    loss.backward()
    return groups, order, nbytes


def test_schedule_prefetches_the_previous_layer_and_gradients_are_bit_identical():
    model = _model()
    ids = torch.randint(0, 40, (1, S), generator=torch.Generator().manual_seed(3))
    model.zero_grad(set_to_none=True)
    _loss(model, ids).backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    groups, order, nbytes = _independent_groups(model, ids)
    grads, stats, log = _run(model, ids)
    for name in reference:
        assert torch.equal(grads[name], reference[name]), name
    assert [i for what, i in log if what == "put"] == list(range(len(groups)))
    assert [i for what, i in log if what == "take"] == order  # each tensor once, as backward needs it
    assert max(groups) == LAYERS and sum(g >= 1 for g in groups) >= LAYERS
    # every take of a group-g tensor is directly followed by prefetches of exactly the group g-1
    # tensors not yet brought back; nothing else is ever copied back ahead of use
    events = [e for e in log if e[0] != "put"]
    expected, fetched = [], set()
    for i in order:
        if i not in fetched:
            expected.append(("fetch", i))
        expected.append(("take", i))
        fetched.add(i)
        ahead = [j for j, g in enumerate(groups) if g == groups[i] - 1 and j not in fetched]
        expected += [("prefetch", j) for j in ahead]
        fetched.update(ahead)
    assert events == expected
    # only the last group (the head's tensors, needed first) is fetched on demand
    on_demand = [i for what, i in log if what == "fetch"]
    assert {groups[i] for i in on_demand} == {LAYERS}
    prefetched = [i for what, i in log if what == "prefetch"]
    assert (stats.tensors, stats.on_demand, stats.prefetched) == (len(groups), len(on_demand), len(prefetched))
    assert stats.bytes == sum(nbytes) >= LAYERS * S * H * 4
    assert stats.prefetched_bytes == sum(nbytes[i] for i in prefetched) >= (LAYERS - 1) * S * H * 4
    assert stats.on_demand_bytes == sum(nbytes[i] for i in on_demand)


def test_device_holds_at_most_the_layer_in_use_and_the_one_prefetched():
    model = _model()
    ids = torch.randint(0, 40, (1, S), generator=torch.Generator().manual_seed(4))
    groups, _, _ = _independent_groups(model, ids)
    _, _, log = _run(model, ids)
    outstanding: set[int] = set()  # copied back, not yet handed to autograd
    for what, i in log:
        if what in ("fetch", "prefetch"):
            outstanding.add(i)
        elif what == "take":
            outstanding.discard(i)
            # the rest of the group in use and the group prefetched, nothing older
            assert {groups[j] for j in outstanding} <= {groups[i], groups[i] - 1}, (i, outstanding)


def test_queue_returns_identical_tensors_in_any_order_and_counts_bytes():
    stats, log = OffloadStats(), []
    queue = OffloadQueue(HostCopies(), stats, log)
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.randn(2, 2, dtype=torch.float64).t()]
    indices = []
    for t in tensors:
        queue.new_group()
        indices.append(queue.put(t))
    for i in (2, 0, 1):
        out = queue.take(indices[i])
        assert torch.equal(out, tensors[i]) and out.dtype == tensors[i].dtype
        assert out.data_ptr() != tensors[i].data_ptr()  # a copy, not the original
    # take(2) prefetches group 2 (tensor 1); take(0) finds group 0 empty; take(1) uses its prefetch
    assert [e for e in log if e[0] != "put"] == [("fetch", 2), ("take", 2), ("prefetch", 1), ("fetch", 0),
                                                 ("take", 0), ("take", 1)]
    sizes = [15 * 4, 7 * 8, 4 * 8]
    assert (stats.tensors, stats.bytes) == (3, sum(sizes))
    assert (stats.prefetched, stats.prefetched_bytes) == (1, sizes[1])
    assert (stats.on_demand, stats.on_demand_bytes) == (2, sizes[2] + sizes[0])
    assert torch.equal(queue.take(indices[1]), tensors[1])  # a second backward (retain_graph) fetches again
    assert stats.on_demand == 3


def test_model_without_checkpointed_layers_prefetches_one_tensor_ahead():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3), nn.Sigmoid())
    x = torch.randn(5, 4)
    model(x).sum().backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    stats, log = OffloadStats(), []
    with offload_saved_tensors(model, torch.device("cpu"), stats, log):
        y = model(x).sum()
    y.backward()
    for p, ref in zip(model.parameters(), reference, strict=True):
        assert torch.equal(p.grad, ref)
    takes = [i for what, i in log if what == "take"]
    assert takes == sorted(takes, reverse=True) and stats.on_demand == 1  # only the last one saved
    assert stats.prefetched == stats.tensors - 1 >= 3
