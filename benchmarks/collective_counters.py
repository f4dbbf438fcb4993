"""What one worker process hands to torch.distributed's collectives, counted per phase, and what gloo itself ran:
the measuring half of benchmarks/sequence_comm.py (imported by the script, not a script itself).

Three independent views of the same traffic, so the script can check each against its closed forms:
  - `wrap_collectives`: the Python entry points Ulysses and ring attention call (`all_to_all_single`,
    `batch_isend_irecv`): calls, input bytes, and the all-to-all bytes that leave the rank;
  - `wrap_tp_collectives`: the `torch.ops._c10d_functional` ops DTensor's redistribution calls (tensor
    parallelism), the c10d entry points (which must see nothing), and the all-gather with which
    rlsp.parallel.tp_sp re-gathers a sequence-parallel block's saved input shard in backward (bound in that
    module at import, so it is counted there, as `tp_sp_regather`);
  - `backend_events`: torch.profiler's `gloo:*` events and their input shapes (collectives issued from C++ too).
Each wrapper replaces a module attribute in this worker process only; callers look the ops up at call time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from rlsp.parallel import tp_sp

FUNCOL_OPS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_reduce_", "broadcast",
              "broadcast_", "all_to_all_single", "all_gather_into_tensor_coalesced",
              "reduce_scatter_tensor_coalesced", "all_reduce_coalesced")
C10D_OPS = tuple(name for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather",
                                   "all_gather_single", "broadcast") if hasattr(dist, name))
TP_OPS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")  # what TP may issue
REGATHER = "tp_sp_regather"  # the counter key of tp_sp's backward re-gather
ELEM_BYTES = {"float": 4, "c10::BFloat16": 2, "double": 8, "c10::Half": 2}  # profiler dtype names


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def wrap_collectives(counter: dict[str, dict[str, int]], phase: list[str]) -> None:
    """Count what this process hands to all_to_all_single / batch_isend_irecv, per phase."""
    a2a, p2p = dist.all_to_all_single, dist.batch_isend_irecv

    def counted_a2a(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any = None,
                    input_split_sizes: Any = None, group: Any = None, **kwargs: Any) -> Any:
        c = counter[phase[0]]
        row = input[0].numel() * input.element_size() if input.dim() else input.element_size()
        own = input_split_sizes[dist.get_rank(group)] if input_split_sizes else input.shape[0] // dist.get_world_size(group)
        c["a2a_calls"] += 1
        c["a2a_bytes"] += nbytes(input)
        c["a2a_off_rank_bytes"] += nbytes(input) - own * row
        return a2a(output, input, output_split_sizes, input_split_sizes, group, **kwargs)

    def counted_p2p(ops: list[dist.P2POp]) -> Any:
        c = counter[phase[0]]
        c["p2p_calls"] += 1
        c["p2p_bytes"] += sum(nbytes(op.tensor) for op in ops if op.op is dist.isend)
        return p2p(ops)

    dist.all_to_all_single, dist.batch_isend_irecv = counted_a2a, counted_p2p  # this worker process only


def _counting(counter: dict[str, dict[str, int]], phase: list[str], key: str, fn: Callable, arg: int = 0) -> Callable:
    """`fn`, counting its calls and the bytes of its positional argument `arg` (the input) under `key`."""
    def counted(*args: Any, **kwargs: Any) -> Any:
        c = counter[phase[0]]
        tensor = args[arg] if len(args) > arg else None
        c[key + "_calls"] = c.get(key + "_calls", 0) + 1
        c[key + "_bytes"] = c.get(key + "_bytes", 0) + (nbytes(tensor) if isinstance(tensor, torch.Tensor) else 0)
        return fn(*args, **kwargs)

    return counted


def wrap_tp_collectives(counter: dict[str, dict[str, int]], phase: list[str]) -> None:
    """Count the input bytes of the functional collectives (DTensor's path), of the c10d entry points and of
    tp_sp's backward re-gather (its input is the second argument: `(out, local, group=...)`), per phase."""
    namespace = torch.ops._c10d_functional
    for name in FUNCOL_OPS:
        setattr(namespace, name, _counting(counter, phase, "funcol_" + name, getattr(namespace, name)))
    for name in C10D_OPS:
        setattr(dist, name, _counting(counter, phase, "c10d_" + name, getattr(dist, name)))
    tp_sp._all_gather = _counting(counter, phase, REGATHER, tp_sp._all_gather, arg=1)


def backend_events(prof: Any) -> dict[str, int]:
    """Calls and input bytes of the collectives gloo ran (profiler events named gloo:*)."""
    out: dict[str, int] = {}
    for event in prof.events():
        if event.name.startswith("gloo:"):
            name = event.name.removeprefix("gloo:")
            shape, dtype = event.input_shapes[0], event.input_dtypes[0]
            out[name + "_calls"] = out.get(name + "_calls", 0) + 1
            out[name + "_bytes"] = out.get(name + "_bytes", 0) + ELEM_BYTES[dtype] * int(torch.Size(shape).numel())
    return out
