"""Argument checks of ring attention (rlsp/parallel/ring.py): shapes, dtypes and devices of q/k/v against the
plan, the kv head index, the soft-cap. Errors name the value and what is legal.

Legend: Tr tokens of this rank, hq / hkv its q / kv heads, D head dim of q and k (Dv of v).
"""

from __future__ import annotations

import torch

from rlsp.parallel.ring_plan import RingPlan


def check_softcap(softcap: float | None) -> None:
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap <= 0):
        raise ValueError(f"softcap={softcap!r}; legal: a positive number (scores -> softcap * tanh(scores / softcap)) "
                         "or None")


def check_inputs(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, plan: RingPlan,
                  kv_index: torch.Tensor | None) -> None:
    Tr = plan.local_len
    if q_THD.dim() != 3 or q_THD.shape[0] != Tr:
        raise ValueError(
            f"q has shape {tuple(q_THD.shape)}; expected [Tr={Tr}, hq, D] (T={plan.total_len}, ring={plan.ring_size})"
        )
    hq, D = q_THD.shape[1], q_THD.shape[2]
    for name, x in (("k", k_THD), ("v", v_THD)):
        # v may have its own head dim (multi-latent attention: Dv != Dk); k has q's
        if x.dim() != 3 or x.shape[0] != Tr or (name == "k" and x.shape[2] != D) or x.shape[1] != k_THD.shape[1]:
            dim = f"D={D}" if name == "k" else "Dv"
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected [Tr={Tr}, hkv, {dim}] like k (k's head dim "
                             f"is q's, D={D}; v's may differ)")
        if x.dtype != q_THD.dtype or x.device != q_THD.device:
            raise ValueError(
                f"{name} is {x.dtype} on {x.device}, q is {q_THD.dtype} on {q_THD.device}; they must match"
            )
    hkv = k_THD.shape[1]
    if kv_index is None:
        if hq and (hkv == 0 or hq % hkv != 0):
            raise ValueError(f"hq={hq} is not a multiple of hkv={hkv}; pass kv_index (the kv head of each q head)")
        return
    # values are checked on CPU only: on an accelerator that would be a host sync per layer
    on_cpu = kv_index.device.type == "cpu" and hq > 0
    if kv_index.shape != (hq,) or (on_cpu and not 0 <= int(kv_index.min()) <= int(kv_index.max()) < hkv):
        raise ValueError(f"kv_index={kv_index.tolist()} must hold hq={hq} kv head indices in [0, {hkv})")
