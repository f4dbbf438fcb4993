"""Attention sinks of ring attention (gpt-oss: one learned logit per q head in the softmax's denominator),
applied ONCE, to the rows' merged output and log-sum-exp after the last ring step, never per block.

With L = log(sum_j exp(s_j)) the rows' log-sum-exp over every visible key (the ring's merge) and o the
matching output, the sink joins the denominator only: L' = logaddexp(L, sink), o' = o * exp(L - L'). The
backward is the ring's own with (o', L'): the block math's probabilities exp(s_j - L') are the true ones and
delta = rowsum(dO * o') (the kernels derive it from the output they are given), so dq/dk/dv stay exact;
the sink's own gradient is d loss / d sink_h = -sum_rows exp(sink_h - L'_h) * delta_h over this rank's rows
(the other ranks' rows add theirs through the parameter's gradient reduction, as for every weight).

Legend: Tr tokens of this rank, H its q heads, D head dim.
"""

from __future__ import annotations

import torch


def apply_sinks(out_THD: torch.Tensor, lse_HT: torch.Tensor,
                sinks_H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out', lse') of rows whose denominator gains exp(sink): out in the accumulation dtype, scaled in place."""
    sink_HT = sinks_H.detach().to(lse_HT.dtype)[:, None].expand_as(lse_HT)
    final_HT = torch.logaddexp(lse_HT, sink_HT)  # finite: the sink is, even for a row without keys
    out_THD.mul_(torch.exp(lse_HT - final_HT).T[..., None])
    return out_THD, final_HT


def sink_grad(do_THD: torch.Tensor, out_THD: torch.Tensor, lse_HT: torch.Tensor,
              sinks_H: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks [H] from this rank's rows (final output and lse), in the sinks' dtype."""
    acc = lse_HT.dtype
    delta_HT = (do_THD.to(acc) * out_THD.to(acc)).sum(dim=-1).T
    p_sink_HT = torch.exp(sinks_H.detach().to(acc)[:, None] - lse_HT)
    return -(p_sink_HT * delta_HT).sum(dim=1).to(sinks_H.dtype)


def check_sinks(sinks_H: torch.Tensor | None, hq: int) -> None:
    if sinks_H is not None and tuple(sinks_H.shape) != (hq,):
        raise ValueError(f"sinks of shape {tuple(sinks_H.shape)}; ring attention takes one sink logit per local q "
                         f"head, shape ({hq},), or None")
