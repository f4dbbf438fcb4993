"""The parallel layout of a run, computed once from the config by `validate_config` and passed down.

A run has one or two training worlds (`MeshLayout`): the policy world hosts the actor, reference and
rollout roles (and the critic when it is colocated, verl's "hybrid" layout); a separate critic pool
is its own world. Ranks are numbered node by node (rank = node * procs_per_node + local rank), and an
sp group is a run of consecutive ranks, so an sp group never straddles nodes as long as sp divides
procs_per_node (checked by validation).

No torch here: this is plain arithmetic that the driver, the controller and the workers share.
"""

from __future__ import annotations

from dataclasses import dataclass

# Advantage estimators that need a value model (critic workers).
CRITIC_ESTIMATORS = ("gae",)


@dataclass(frozen=True)
class MeshLayout:
    """One training world: nnodes x procs_per_node ranks, split into dp groups of sp_size ranks."""

    nnodes: int
    procs_per_node: int
    sp_size: int

    @property
    def world_size(self) -> int:
        return self.nnodes * self.procs_per_node

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    def dp_rank(self, rank: int) -> int:
        return rank // self.sp_size

    def sp_rank(self, rank: int) -> int:
        return rank % self.sp_size

    def node_of(self, rank: int) -> int:
        return rank // self.procs_per_node

    def with_sp(self, sp_size: int) -> MeshLayout:
        return MeshLayout(self.nnodes, self.procs_per_node, sp_size)


@dataclass(frozen=True)
class ParallelLayout:
    """Every training world of the run and which roles live on which.

    `policy` is the world of the actor/reference/rollout workers; `critic` is the critic's mesh (None
    without a critic). With `critic_colocated` the critic shares the policy world (same ranks and
    devices) with its own sp size; otherwise `critic` is a world of its own.
    """

    policy: MeshLayout
    critic: MeshLayout | None = None
    critic_colocated: bool = True

    # Shorthands for the policy world (the one every run has).
    @property
    def world_size(self) -> int:
        return self.policy.world_size

    @property
    def sp_size(self) -> int:
        return self.policy.sp_size

    @property
    def dp_size(self) -> int:
        return self.policy.dp_size

    @property
    def total_workers(self) -> int:
        """Worker processes the run starts: the policy world plus a separate critic pool, if any."""
        separate = self.critic is not None and not self.critic_colocated
        return self.policy.world_size + (self.critic.world_size if separate else 0)

    @property
    def has_critic(self) -> bool:
        return self.critic is not None

    def role_mesh(self, role: str) -> MeshLayout:
        """The mesh a role trains or infers on."""
        if role == "critic":
            if self.critic is None:
                raise ValueError("this run has no critic (algorithm.adv_estimator does not use one)")
            return self.critic
        if role in ("actor", "ref", "rollout"):
            return self.policy
        raise ValueError(f"unknown role {role!r}; legal roles: actor, ref, rollout, critic")

    def roles_of(self, group: str) -> tuple[str, ...]:
        """Roles hosted by a worker group: 'policy' (always) or 'critic' (separate pool only)."""
        if group == "policy":
            colocated = ("critic",) if self.has_critic and self.critic_colocated else ()
            return ("actor", "ref", "rollout", *colocated)
        if group == "critic" and self.has_critic and not self.critic_colocated:
            return ("critic",)
        raise ValueError(f"no worker group {group!r} in this layout")

    def describe(self) -> str:
        p = self.policy
        text = f"world={p.world_size} ({p.nnodes}x{p.procs_per_node}) dp={p.dp_size} sp={p.sp_size}"
        if self.critic is not None:
            c = self.critic
            where = "colocated" if self.critic_colocated else f"own pool {c.nnodes}x{c.procs_per_node}"
            text += f" | critic {where} dp={c.dp_size} sp={c.sp_size}"
        return text
