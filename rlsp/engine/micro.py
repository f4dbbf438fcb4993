"""One packed micro-batch as a rank sees it: the padded rows, their packed stream and the sp context.

A rank's model inputs are its sequence-parallel shard [S] of the stream (S = T / (ulysses x ring));
the ranks of a tp group share it. Its outputs cover the same [S] tokens, or, with tensor
parallelism's sequence-parallel activations, the tp rank's contiguous [S/tp] block of them.

Legend: B rows, P prompt width, R response width, T packed stream, S local tokens (model inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlsp.data.balance import count_token_bins, plan_token_bins
from rlsp.data.batch import Batch
from rlsp.data.packing import PackedBatch, pack_sequences
from rlsp.engine.adaptive_plan import plan_adaptive_rounds
from rlsp.engine.stream import response_to_stream
from rlsp.models.vision_inputs import MM_KEY, MultiModalRows
from rlsp.parallel.mesh import ParallelDims
from rlsp.parallel.tensor_parallel import TPInfo
from rlsp.parallel.ulysses import SPContext, build_sp_context, gather_from_ranks, shard_for_rank


@dataclass
class MicroBatch:
    rows: Batch
    packed: PackedBatch
    ctx: SPContext
    prompt_len: int
    response_len: int
    tp: TPInfo | None = None

    def multi_modal_kwargs(self) -> dict[str, MultiModalRows]:
        """The head kwarg carrying the rows' images (rlsp.models.vision_lm), or none when no row has an image."""
        entries = self.rows.meta.get(MM_KEY)
        if entries is None or all(e is None for e in entries):
            return {}
        return {"multi_modal": MultiModalRows(list(entries), self.packed, self.prompt_len)}

    def local(self, values_T: torch.Tensor) -> torch.Tensor:
        """This rank's model-input shard [S] of a stream tensor [T]."""
        return shard_for_rank(values_T, self.ctx)

    def out_local(self, values_T: torch.Tensor) -> torch.Tensor:
        """The tokens of a stream tensor [T] that this rank's head outputs cover ([S] or [S/tp])."""
        local = self.local(values_T)
        return local if self.tp is None else self.tp.local_tokens(local)

    @property
    def out_len(self) -> int:
        return self.ctx.local_len if self.tp is None else self.tp.local_len(self.ctx.local_len)

    def response_local(self, key: str) -> torch.Tensor:
        """This rank's tokens of a [B, R] response field of the rows, laid out like the head outputs."""
        return self.response_values_local(self.rows[key])

    def response_values_local(self, values_BR: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of per-response values [B, R] of these rows (e.g. loss weights computed
        from the full rows), laid out like the head outputs."""
        return self.out_local(response_to_stream(values_BR, self.packed, self.prompt_len))

    def gather(self, values_out: torch.Tensor) -> torch.Tensor:
        """Head outputs of every rank -> the full stream [T] in order (collective; not differentiable)."""
        if self.tp is not None and self.tp.sequence_parallel:
            pieces = [torch.empty_like(values_out) for _ in range(self.tp.size)]
            dist.all_gather(pieces, values_out.contiguous(), group=self.tp.group)
            values_out = torch.cat(pieces)
        return gather_from_ranks(values_out, self.ctx)


def prepare_micro_batch(rows: Batch, prompt_len: int, dims: ParallelDims | None, num_q_heads: int,
                        num_kv_heads: int, tp: TPInfo | None = None, degree: int | None = None) -> MicroBatch:
    """Pack `rows` into one stream and build its sp context over the groups of `dims` (None: unsharded,
    one rank holds the whole stream). The stream is padded to the layout's `stream_multiple`; the head
    counts are those one rank's attention sees (a tp rank's share under tensor parallelism). With
    adaptive sequence parallelism `degree` is this micro-batch's Ulysses degree (ring and tp are 1)."""
    if dims is None:
        multiple, groups = 1, (None, None, None)
    elif degree is not None:
        multiple, groups = degree, (dims.ulysses_group_of(degree), None, None)
    else:
        multiple, groups = dims.layout.stream_multiple, (dims.ulysses_group, dims.ring_group, dims.ring_dkv_group)
    packed = pack_sequences(rows["input_ids"], rows["attention_mask"], pad_to_multiple=multiple)
    ctx = build_sp_context(groups[0], packed, num_q_heads, num_kv_heads, ring_group=groups[1], ring_dkv_group=groups[2])
    response_len = rows["input_ids"].shape[1] - prompt_len
    return MicroBatch(rows=rows, packed=packed, ctx=ctx, prompt_len=prompt_len, response_len=response_len, tp=tp)


@dataclass(frozen=True)
class MicroPlan:
    """One micro-batch of a rank: its rows, its Ulysses degree (adaptive only; None = the layout's) and
    whether this rank's copy of the results counts (adaptive: one rank per sub-group reports)."""

    rows: list[int]
    degree: int | None = None
    reports: bool = True


def plan_micro_batches(batch: Batch, micro_size: int, max_tokens: int | None, dims: ParallelDims,
                       quad_tokens: float | None = None) -> list[MicroPlan]:
    """This rank's micro-batches (collective when `max_tokens` is set): fixed-size or token-budget
    micro-batches at the layout's degrees, or, with adaptive sequence parallelism and a token budget,
    rounds at the smallest Ulysses degree that holds them, the lanes of a round balanced by work
    (`plan_adaptive_rounds`; `quad_tokens` weighs attention's quadratic part). Every rank of the
    world runs the same number of micro-batches (FSDP's collectives); spare rounds are idle ones."""
    layout = dims.layout
    if max_tokens is None or not layout.adaptive:
        return [MicroPlan(idx) for idx in split_rows(batch, micro_size, max_tokens, layout.token_shards)]
    rounds = plan_adaptive_rounds(batch["attention_mask"].sum(-1).tolist(), max_tokens, layout.ulysses, quad_tokens)
    total = torch.tensor([len(rounds)], dtype=torch.int64)
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    rank = dims.coords.ulysses
    plans = [_lane_plan(lanes, rank) for lanes in rounds]
    return plans + [MicroPlan([], 1, False)] * (int(total) - len(rounds))


def _lane_plan(lanes: list[tuple[int, list[int]]], rank: int) -> MicroPlan:
    """Ulysses rank `rank`'s micro-batch in a round of lanes (degree, rows) laid out in rank order; the
    lane's first rank reports its results."""
    first = 0
    for degree, rows in lanes:
        if first <= rank < first + degree:
            return MicroPlan(rows, degree, rank == first)
        first += degree
    raise ValueError(f"Ulysses rank {rank} is in no lane of {lanes}")


def merge_reported(outs: dict[str, torch.Tensor], dims: ParallelDims) -> None:
    """Adaptive sequence parallelism's results, in place: each micro-batch's rows were written by the one
    reporting rank of its sub-group (zeros elsewhere), so the Ulysses group's sum gives every rank all
    of them (collective over that group)."""
    if dims.ulysses_group is not None:
        for out in outs.values():
            dist.all_reduce(out, group=dims.ulysses_group)


def plan_rows(batch: Batch, plan: MicroPlan) -> Batch:
    """The rows of a micro-batch; an idle one (no rows) is the first row with every token masked out: a
    stream of padding that runs the same collectives and contributes nothing."""
    if plan.rows:
        return batch.select_rows(plan.rows)
    idle = batch.select_rows([0])
    for key in ("attention_mask", "response_mask"):
        if key in idle:
            idle.set(key, torch.zeros_like(idle[key]))
    return idle


def split_rows(batch: Batch, micro_size: int, max_tokens: int | None, token_shards: int) -> list[list[int]]:
    """Row indices of each micro-batch of this rank's `batch` (collective when `max_tokens` is set).

    Fixed size: consecutive runs of `micro_size` rows. Token budget (`max_tokens` per rank, so a packed
    stream holds up to max_tokens * token_shards tokens, the pieces the layout cuts a stream into):
    every rank of the world runs the same number of micro-batches — the largest any rank needs —
    because each forward's FSDP all-gathers are collective.
    """
    n = len(batch)
    if max_tokens is None:
        return [list(range(i, min(i + micro_size, n))) for i in range(0, n, micro_size)]
    lengths = batch["attention_mask"].sum(-1).tolist()
    budget = max_tokens * token_shards
    need = torch.tensor([count_token_bins(lengths, budget), -n], dtype=torch.int64)
    dist.all_reduce(need, op=dist.ReduceOp.MAX)
    most, fewest_rows = int(need[0]), int(-need[1])
    return plan_token_bins(lengths, budget, min(most, fewest_rows))
