"""The inputs of the planner's memory model (rlsp.plan.memory): the options that change memory but not the layout,
the heads the busiest rank holds inside attention, and one role's workload (its layout and the micro-batch it runs).

Legend: T stream tokens, S = T / (ulysses x ring) tokens of a sequence shard, s tokens a rank keeps
outside the projections (S / tp with sequence-parallel activations, else S), Tr = T / ring tokens
inside attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlsp.config.auto_memory import RankSpan
from rlsp.config.layout import RoleLayout


@dataclass(frozen=True)
class MemoryOptions:
    """Settings that change memory but not the parallel layout."""

    dtype_bytes: int = 2  # compute dtype: 2 for bfloat16, 4 for float32
    checkpointing: bool = False
    tiled_mlp_shards: int = 0  # 0: off; n: the MLP runs over n token tiles (recomputed in backward)
    activation_offload: bool = False  # checkpointed layer inputs kept in host memory (needs checkpointing)
    logprob_chunk: int = 1024  # actor_rollout_ref.actor.logprob_chunk_size
    param_offload: bool = False  # FSDP2 CPUOffloadPolicy: every role's shards, gradients, AdamW state in host memory
    entropy_grad: bool = False  # actor.entropy_coeff != 0: the head's backward forms the entropy's gradient too
    lean_norm: bool = False  # model.lean_rmsnorm: a norm keeps its input and fp32 1/rms per token (rlsp/models/rms_norm.py)
    flash: bool = True  # flash_attn runs windowed / soft-capped layers (CUDA); False: rlsp's torch banded kernel


@dataclass(frozen=True)
class HeadShare:
    """Heads the busiest rank holds inside attention (after the tp and Ulysses splits)."""

    q: int
    kv: int


@dataclass(frozen=True)
class Workload:
    """One role's layout and the micro-batch it runs: `budget` tokens per rank, sequences of up to
    `seq_len` tokens, `heads` the busiest rank's share inside attention."""

    layout: RoleLayout
    budget: int
    seq_len: int
    heads: HeadShare
    image_tokens: int = 0  # image tokens per sequence (its prompt's images); 0: text-only data

    @property
    def rank_image_tokens(self) -> int:
        """Image tokens whose patches this rank encodes: its share of the stream's images (rlsp.models.vision_lm
        spreads them over the ranks of a stream by patches)."""
        return -(-self.shard * min(self.image_tokens, self.seq_len) // self.seq_len)

    @property
    def stream(self) -> int:
        """T: tokens of one packed stream (the budget times the pieces the layout cuts it into)."""
        return self.budget * self.layout.token_shards

    @property
    def shard(self) -> int:
        """S: tokens of a sequence shard (outside attention, before tp's sequence split)."""
        return self.stream // self.layout.sp_size

    @property
    def kept(self) -> int:
        """s: tokens a rank keeps in the residual stream (S / tp with sequence-parallel activations)."""
        return self.shard // self.layout.tp if self.layout.tp_shards_tokens else self.shard

    @property
    def heads_len(self) -> int:
        """Tr: tokens a rank sees inside attention (its ring share of the stream)."""
        return self.stream // self.layout.ring

    def span(self, flash: bool = True) -> RankSpan:
        """This rank's share of a layer, as rlsp.config.auto_memory's per-kind terms take it."""
        u, ring, tp = self.layout.ulysses, self.layout.ring, self.layout.tp  # ring alone: o_proj reads attention's output
        return RankSpan(self.heads_len, self.shard, self.heads.q, self.heads.kv, u, tp, self.seq_len, flash, u > 1 or ring == 1)
