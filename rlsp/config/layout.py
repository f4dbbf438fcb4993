"""The parallel layout of a run, built once from the config (`rlsp.config.layout_build.build_layout`,
called by `validate_config`) and passed down: nothing re-decides placement from the raw config.

A run has one or two pools of worker processes (`World`): the policy pool hosts the actor,
reference and rollout roles (and the critic when it is colocated, verl's "hybrid" layout); a separate
critic pool is a world of its own. Ranks are numbered node by node (rank = node * procs_per_node +
local rank).

Each training role splits its world with its own degrees (`RoleLayout`), ranks ordered
(dp, ring, ulysses, tp) from outermost to innermost:

    rank = ((dp_rank * ring + ring_rank) * ulysses + ulysses_rank) * tp + tp_rank

- tp (tensor parallel, innermost) and ulysses (head all-to-all) are the chattiest: their groups are
  runs of consecutive ranks that stay inside a node (validation requires ulysses * tp to divide the
  workers per node);
- ring (K/V blocks passed to the neighbour) may span nodes: only neighbour-to-neighbour traffic
  crosses the slow link;
- dp ranks get different rows; the ulysses x ring x tp ranks of one dp group share their rows.
A packed token stream is cut into ring zigzag chunks, each ring rank's tokens into ulysses slices,
and, with tensor parallelism's sequence-parallel activations, each of those into tp slices. FSDP2
shards parameters over the dp x ring x ulysses ranks (all but tp), or within groups of `fsdp_size`
of them (HSDP); tp shards the weights of each layer across its group.

Expert parallelism (`ep`, tp 1 only) is carved from those same FSDP ranks: runs of `ep` consecutive ranks
(an expert-parallel group: the Ulysses/ring ranks of one row set first, then neighbouring dp groups) split
every MoE layer's experts on dim 0, and every rank holds different tokens (rows or sequence shards), which
its MoE layers dispatch to the experts' owners. The ranks with the same expert-parallel position
(`ep_replicas` of them, rank % ep equal) hold the same experts; FSDP2 shards those experts over them,
everything else over all FSDP ranks as without EP (rlsp.parallel.expert_parallel).

No torch here: plain arithmetic shared by the driver, the controller, the workers and the planner.
"""

from __future__ import annotations

from dataclasses import dataclass

# Advantage estimators that need a value model (critic workers).
CRITIC_ESTIMATORS = ("gae",)
# How rewards are computed, which decides what runs where (`ParallelLayout.reward_mode`):
#   rules          rule/custom reward functions in reward_model.num_workers scoring actors (rlsp.step.reward)
#   model_fsdp     a frozen reward model on the policy workers, FSDP2 (reward_model.use_reward_loop=false)
#   model_vllm     verl's reward loop: a vLLM pooling engine in the policy workers' processes
#   model_servers  the reward loop's engines in processes of their own beside the policy workers (a rollout
#                  engine of another tensor-parallel degree shares the policy workers)
REWARD_MODES = ("rules", "model_fsdp", "model_vllm", "model_servers")


@dataclass(frozen=True)
class World:
    """The worker processes of one pool: nnodes x procs_per_node ranks, numbered node by node."""

    nnodes: int
    procs_per_node: int

    @property
    def world_size(self) -> int:
        return self.nnodes * self.procs_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.procs_per_node


@dataclass(frozen=True)
class Coords:
    """Where one rank sits in its role's layout."""

    dp: int
    ring: int
    ulysses: int
    tp: int


@dataclass(frozen=True)
class RoleLayout:
    """How one training role splits its world: every parallel degree (see the module docstring)."""

    world: World
    ulysses: int = 1
    ring: int = 1
    tp: int = 1
    sequence_parallel: bool = True  # with tp > 1: norm/residual activations sharded along the sequence
    fsdp_size: int = -1  # -1: shard over all dp x ring x ulysses ranks; else HSDP groups of this size
    adaptive: bool = False  # each micro-batch at the smallest Ulysses degree whose token budget holds it
    ep: int = 1  # expert parallel: runs of `ep` consecutive ranks split every MoE layer's experts (tp 1 only)

    @property
    def world_size(self) -> int:
        return self.world.world_size

    @property
    def sp_size(self) -> int:
        """Ranks one sequence is split over inside attention: ulysses x ring."""
        return self.ulysses * self.ring

    @property
    def tp_shards_tokens(self) -> bool:
        return self.tp > 1 and self.sequence_parallel

    @property
    def ranks_per_dp(self) -> int:
        """Ranks that work on the same rows (one dp group's model replica): ulysses x ring x tp."""
        return self.ulysses * self.ring * self.tp

    @property
    def dp_size(self) -> int:
        return self.world_size // self.ranks_per_dp

    @property
    def token_shards(self) -> int:
        """Pieces a packed stream is cut into outside attention: each rank holds 1/token_shards of it."""
        return self.sp_size * (self.tp if self.tp_shards_tokens else 1)

    @property
    def token_replicas(self) -> int:
        """Ranks whose head outputs cover the same tokens: tp without sequence-parallel activations."""
        return self.tp if self.tp > 1 and not self.sequence_parallel else 1

    @property
    def stream_multiple(self) -> int:
        """A packed stream's length must be a multiple of this (ring zigzag uses 2 chunks per ring rank)."""
        return self.token_shards * (2 if self.ring > 1 else 1)

    @property
    def fsdp_ranks(self) -> int:
        """Ranks FSDP2 shards parameters over: every rank of the world but the tp dimension."""
        return self.world_size // self.tp

    @property
    def fsdp_shard(self) -> int:
        """Ranks one copy of the parameters is sharded over (the whole fsdp_ranks unless HSDP)."""
        return self.fsdp_ranks if self.fsdp_size == -1 else self.fsdp_size

    @property
    def ep_replicas(self) -> int:
        """Ranks holding the same experts (one per expert-parallel group): FSDP2 shards those experts over them."""
        return self.fsdp_ranks // self.ep

    def coords(self, rank: int) -> Coords:
        rest, tp_rank = divmod(rank, self.tp)
        rest, uly = divmod(rest, self.ulysses)
        dp, ring = divmod(rest, self.ring)
        return Coords(dp=dp, ring=ring, ulysses=uly, tp=tp_rank)

    def dp_rank(self, rank: int) -> int:
        return rank // self.ranks_per_dp

    @property
    def ulysses_degrees(self) -> tuple[int, ...]:
        """Ulysses degrees a micro-batch may run at: every divisor of `ulysses` when adaptive, else it alone."""
        if not self.adaptive:
            return (self.ulysses,)
        return tuple(d for d in range(1, self.ulysses + 1) if self.ulysses % d == 0)

    def describe(self) -> str:
        text = f"dp={self.dp_size} ulysses={self.ulysses}{' (adaptive)' if self.adaptive else ''} ring={self.ring} tp={self.tp}"
        if self.tp > 1:
            text += " (sequence-parallel activations)" if self.sequence_parallel else " (replicated activations)"
        if self.fsdp_size != -1:
            text += f" fsdp_size={self.fsdp_size}"
        if self.ep > 1:
            text += f" ep={self.ep}"
        return text


@dataclass(frozen=True)
class ParallelLayout:
    """Every worker pool of the run, every training role's degrees, and which roles live where.

    `policy` is the pool of the actor/reference/rollout workers; `actor`, `ref` and `critic` split
    their pool each with their own degrees (`critic` is None without a critic). With
    `critic_colocated` the critic shares the policy pool (same ranks and devices); otherwise its
    layout's `world` is a pool of its own. `reward_model` (None without one) splits the policy pool
    too, or with `reward_servers` (the reward loop beside a rollout engine of another tensor-parallel
    degree) is served by one process of its own per policy worker; a rollout engine spans `rollout_tp`
    consecutive ranks.
    """

    policy: World
    actor: RoleLayout
    ref: RoleLayout
    critic: RoleLayout | None = None
    critic_colocated: bool = True
    rollout: World | None = None  # a rollout pool of its own (async training); None: engines on the policy workers
    rollout_tp: int = 1  # vLLM tensor parallelism: consecutive ranks of the rollout pool that run one engine together
    reward_model: RoleLayout | None = None  # the frozen reward model's split of the policy pool (reward_model.enable)
    reward_mode: str = "rules"  # one of REWARD_MODES
    teachers: bool = False  # distillation teachers on the policy workers, in the reference's layout (distillation.enabled)
    has_reference: bool = True  # the reference model is placed: KL loss (use_kl_loss) or KL in the reward

    def __post_init__(self) -> None:
        if self.reward_mode not in REWARD_MODES:
            raise ValueError(f"reward_mode={self.reward_mode!r}; legal values: {list(REWARD_MODES)}")
        if (self.reward_model is not None) != self.reward_mode.startswith("model_"):
            raise ValueError(f"reward_mode={self.reward_mode!r} does not match reward_model="
                             f"{'set' if self.reward_model is not None else 'None'}")

    @property
    def reward_servers(self) -> bool:
        """The reward loop's engines run in processes beside the policy workers, not in them."""
        return self.reward_mode == "model_servers"

    # Shorthands for the policy pool and the actor's split (the ones every run has).
    @property
    def world_size(self) -> int:
        return self.policy.world_size

    @property
    def dp_size(self) -> int:
        return self.actor.dp_size

    @property
    def total_workers(self) -> int:
        """Worker processes the run starts: the policy pool plus a separate critic pool, if any."""
        separate = self.critic is not None and not self.critic_colocated
        pool = self.rollout.world_size if self.rollout is not None else 0
        return self.world_size + (self.critic.world_size if separate else 0) + pool

    @property
    def has_critic(self) -> bool:
        return self.critic is not None

    def role(self, name: str) -> RoleLayout:
        """The layout a role trains or infers on (rollout: one engine per rank of the policy pool)."""
        if name == "critic":
            if self.critic is None:
                raise ValueError("this run has no critic (algorithm.adv_estimator does not use one)")
            return self.critic
        if name in ("actor", "ref"):
            return getattr(self, name)
        if name == "teacher":  # distillation teachers run in the reference's layout
            return self.ref
        if name == "rollout":  # one engine per group of rollout_tp ranks (dp = engines)
            return RoleLayout(self.rollout or self.policy, tp=self.rollout_tp)
        if name == "reward_model" and self.reward_model is not None:
            return self.reward_model
        raise ValueError(f"unknown role {name!r}; legal roles: actor, ref, rollout, critic, reward_model (with "
                         "reward_model.enable=true)")

    def world_of(self, group: str) -> World:
        """The pool of a worker group: 'policy', 'critic' or 'rollout' (separate pools only)."""
        if group == "rollout" and self.rollout is not None:
            return self.rollout
        return self.policy if group == "policy" else self.role("critic").world

    def roles_of(self, group: str) -> tuple[str, ...]:
        """Roles hosted by a worker group: 'policy' (always), 'critic' or 'rollout' (separate pools only)."""
        if group == "policy":
            colocated = ("critic",) if self.has_critic and self.critic_colocated else ()
            engines = ("rollout",) if self.rollout is None else ()
            scorer = ("reward_model",) if self.reward_model is not None and not self.reward_servers else ()
            return ("actor", "ref", *engines, *colocated, *scorer, *(("teacher",) if self.teachers else ()))
        if group == "rollout" and self.rollout is not None:
            return ("rollout",)
        if group == "critic" and self.has_critic and not self.critic_colocated:
            return ("critic",)
        raise ValueError(f"no worker group {group!r} in this layout")

    def node_local_sizes(self, group: str) -> tuple[int, ...]:
        """Sizes of the rank runs that must share a node in this group (ulysses x tp of each role; a
        rollout engine's tp group)."""
        roles = [r for r in self.roles_of(group) if r != "rollout" or self.rollout_tp > 1]
        return tuple(sorted({self.role(r).ulysses * self.role(r).tp for r in roles}))

    def describe(self) -> str:
        p = self.policy
        text = f"world={p.world_size} ({p.nnodes}x{p.procs_per_node}) actor {self.actor.describe()}"
        if self.ref != self.actor:
            text += f" | ref {self.ref.describe()}"
        if self.critic is not None:
            c = self.critic.world
            where = "colocated" if self.critic_colocated else f"own pool {c.nnodes}x{c.procs_per_node}"
            text += f" | critic {where} {self.critic.describe()}"
        if self.rollout is not None:
            text += f" | rollout own pool {self.rollout.nnodes}x{self.rollout.procs_per_node}"
        if self.rollout_tp > 1:
            text += f" | rollout tp={self.rollout_tp}"
        if self.reward_model is not None:
            where = " in processes of its own" if self.reward_servers else ""
            text += f" | reward_model{where} {self.reward_model.describe()}"
        return text
