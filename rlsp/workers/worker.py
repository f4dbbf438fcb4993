"""Worker: one process per device, assembled from the roles placed on it.

A plain class (no ray import): the controller wraps it as a Ray actor, tests drive it directly. The
policy group's workers host actor + rollout (+ reference when a KL term needs it — with LoRA the
actor's base, adapters off, on the actor's engine —, + critic when it is colocated: verl's hybrid
layout, every role sharing the device, + the reward model with reward_model.enable); a separate
critic pool's workers host the critic only. Role methods are reached through
`execute(role, method, ...)`; each declares its dispatch contract where it is defined (see
rlsp/workers/dispatch.py).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.constants import default_pg_timeout
from transformers import AutoTokenizer

from rlsp.config.layout import ParallelLayout
from rlsp.data.batch import Batch
from rlsp.rewards.scoring import Scorer, manager_extra_info
from rlsp.utils.device import backend_for, device_for, resolve_device_type
from rlsp.utils.dtypes import resolve_dtype
from rlsp.utils.logging import get_logger
from rlsp.utils.seeding import seed_everything
from rlsp.workers.columns import COLUMNS_INFO, RowsSpec, assemble, row_report
from rlsp.workers.context import RoleContext, group_timeout
from rlsp.workers.dispatch import Dispatch, declared_fields, register
from rlsp.workers.roles import ROLE_CLASSES

log = get_logger("rlsp.worker")


LOOPBACK = "127.0.0.1"


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def loopback_interface() -> str | None:
    """The name of the loopback network interface (`lo` on Linux), or None if there is none to find."""
    root = "/sys/class/net"
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        try:
            with open(os.path.join(root, name, "flags")) as f:
                if int(f.read(), 16) & 0x8:  # IFF_LOOPBACK
                    return name
        except (OSError, ValueError):
            continue
    return None


class Worker:
    def __init__(self, layout: ParallelLayout, group: str, rank: int) -> None:
        # The run's config comes with `init_worker`: the process (its imports) may start while the driver
        # still checks the config (rlsp.controller.ray_session).
        self.cfg: DictConfig | None = None
        self.layout, self.group, self.rank = layout, group, rank
        self.world = layout.world_of(group)
        self.placed = [r for r in layout.roles_of(group) if r != "ref" or layout.has_reference]
        self.roles: dict[str, Any] = {}
        self.scorer: Scorer | None = None  # rule scoring in this process, built by the first `score`
        self._store_socket: socket.socket | None = None  # rank 0 of a one-node run, until the store adopts it
        os.environ["RANK"] = str(rank)

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0: where the process group meets. On one node rank 0 opens the store's listening socket
        itself, on 127.0.0.1: torch's TCPStore would otherwise listen on every interface, whatever host
        it is given. The store adopts the socket in `init_worker`."""
        if self.world.nnodes > 1:
            return socket.gethostbyname(socket.gethostname()), find_free_port()
        self._store_socket = socket.create_server((LOOPBACK, 0))
        return LOOPBACK, int(self._store_socket.getsockname()[1])

    def _init_process_group(self, backend: str, master_addr: str, master_port: int) -> None:
        world = self.world.world_size
        os.environ.update(RANK=str(self.rank), LOCAL_RANK="0", WORLD_SIZE=str(world),
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        timeout = group_timeout(self.cfg)  # the mesh groups get it too (rlsp.parallel.mesh)
        if self.world.nnodes > 1:  # the store listens on all interfaces of rank 0's node
            dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                                    rank=self.rank, world_size=world, timeout=timeout)
            return
        # One node: gloo (ours and vLLM's) binds where GLOO_SOCKET_IFNAME says, else to the address the
        # host name resolves to, which may be an external one.
        if (lo := loopback_interface()) is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
        sock, self._store_socket = self._store_socket, None
        if (sock is None) != (self.rank != 0):
            raise RuntimeError(f"rank {self.rank}: only rank 0 opens the store socket, in rendezvous_address()")
        # The store takes the detached descriptor over and closes it (checked with torch's libuv backend).
        store = dist.TCPStore(master_addr, master_port, world, is_master=sock is not None,
                              timeout=default_pg_timeout, wait_for_workers=False, use_libuv=True,
                              master_listen_fd=sock.detach() if sock is not None else None)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=world, timeout=timeout)

    # ------------------------------------------------------------------ set-up
    def configure(self, config: dict[str, Any]) -> None:
        """Take the run's config (checked and resolved by the driver); `init_worker` does it first."""
        self.cfg = OmegaConf.create(config)

    @register(Dispatch.ALL)
    def init_worker(self, config: dict[str, Any], master_addr: str, master_port: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.configure(config)
        device_type = resolve_device_type(self.cfg.trainer.device)
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        tokenizer = AutoTokenizer.from_pretrained(self.cfg.actor_rollout_ref.model.path)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._init_process_group(backend_for(device_type), master_addr, master_port)
        ctx = RoleContext(self.cfg, self.rank, self.layout, device_for(device_type), int(pad))
        # The rollout engine first: vLLM re-seeds the global RNGs while it is built, so training
        # seeds are set after it; then every role in a fixed order (their meshes are collective).
        if "rollout" in self.placed:
            self.roles["rollout"] = ROLE_CLASSES["rollout"](ctx)
            # asleep while the training roles and a reward engine start beside it: on a GPU each vLLM
            # engine's start-up needs its gpu_memory_utilization free (rlsp.config.validate_gpu_memory)
            self.roles["rollout"].sleep()
        seed_everything(self.cfg.trainer.seed)
        for role in ("actor", "ref", "critic", "reward_model", "teacher"):
            if role in self.placed:
                # The reference gets the actor: with LoRA it is the actor's base (adapters off), no engine of its own.
                extra = (self.roles.get("actor"),) if role == "ref" else ()
                self.roles[role] = ROLE_CLASSES[role](ctx, *extra)
        if "rollout" in self.roles and "actor" in self.roles and self._rollout_starts_stale():
            self.sync_weights()
            self.roles["rollout"].sleep()  # reward servers start after this: the engine wakes to generate
        log.info("worker ready in %.1fs (roles %s)", time.perf_counter() - t0, ", ".join(self.roles))
        return {"rank": self.rank, "roles": list(self.roles), "init_s": time.perf_counter() - t0,
                "torch_threads": torch.get_num_threads(),
                # the device a process placed beside this worker shares (rlsp.controller.reward_servers)
                "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES") if device_type == "cuda" else None}

    # ------------------------------------------------------------------ calls
    def execute(self, role: str, method: str, *args: Any) -> Any:
        """Run `role.method(*args)` on this worker (the controller has checked its dispatch contract)."""
        if role not in self.roles:
            raise ValueError(f"role {role!r} is not placed on this {self.group} worker; it has {sorted(self.roles)}")
        return getattr(self.roles[role], method)(*args)

    def execute_rows(self, role: str, method: str, spec: RowsSpec, args: tuple[Any, ...],
                     *blocks: Batch) -> tuple[Batch | None, Any]:
        """Run a BY_DP `role.method` on the rows `spec` builds from `blocks` (the declared columns only):
        (the Batch it returns, kept in this process — None on ranks that do not answer for their dp
        group —, what the driver receives: the declared per-row reports, or the method's own result)."""
        if role not in self.roles:
            raise ValueError(f"role {role!r} is not placed on this {self.group} worker; it has {sorted(self.roles)}")
        fields = declared_fields(type(self.roles[role]), method)
        rows = assemble(spec, blocks)
        if extra := (set(rows.tensors.keys()) | set(rows.meta)) - fields.reads:
            raise RuntimeError(f"{role}.{method} was sent fields it does not declare: {sorted(extra)}")
        try:
            result = getattr(self.roles[role], method)(rows, *args)
        except KeyError as exc:
            raise RuntimeError(f"{role}.{method} read {exc} which it was not sent: it declares reads "
                               f"{sorted(fields.reads)} and these rows have {sorted(rows.keys())}") from exc
        answers = self.rank % self.layout.role(role).ranks_per_dp == 0
        if not isinstance(result, Batch):
            return None, result
        if extra := (set(result.tensors.keys()) | set(result.meta)) - fields.writes:
            raise RuntimeError(f"{role}.{method} returned fields it does not declare: {sorted(extra)} "
                               f"(declared writes {sorted(fields.writes)})")
        if not answers:
            return None, None
        merged = result if fields.new_rows else rows.copy().update(result)
        report = row_report(merged, fields.reports)
        report.info[COLUMNS_INFO] = (sorted(result.tensors.keys()), sorted(result.meta))  # what this block holds
        return result, report

    def score(self, spec: RowsSpec, *blocks: Batch) -> tuple[Any, int, list[dict[str, Any]]]:
        """Rule scores of the rows `spec` builds from `blocks`, as a scoring process returns them
        (rlsp.controller.reward_workers: with reward_model.num_workers=0 the policy workers score)."""
        if self.scorer is None:
            r = self.cfg.reward
            tokenizer = AutoTokenizer.from_pretrained(self.cfg.actor_rollout_ref.model.path)
            self.scorer = Scorer(tokenizer, r.custom_function_path, r.custom_function_name, r.on_error,
                                 manager_extra_info(r.reward_manager.name, self.cfg.trainer.experiment_name))
        return self.scorer.score_report(assemble(spec, blocks))

    def _rollout_starts_stale(self) -> bool:
        """The rollout engine starts from model.path's weights (random ones with load_format=dummy); the
        actor differs from those when it continues from a saved LoRA adapter."""
        arr = self.cfg.actor_rollout_ref
        return arr.rollout.load_format == "dummy" or bool(arr.model.lora_adapter_path)

    @register(Dispatch.ALL)
    def sync_weights(self) -> dict[str, float]:
        """Push the actor's full weights into this rank's rollout engine, parameter by parameter (with
        LoRA: merged into the base weights, under their base names)."""
        t0 = time.perf_counter()
        dtype = resolve_dtype(self.cfg.actor_rollout_ref.rollout.dtype)
        self.roles["rollout"].load_weights(self.roles["actor"].rollout_weights(dtype))
        return {"timing/weight_sync_s": time.perf_counter() - t0}

    @register(Dispatch.ALL)
    def save_rng(self, ckpt_dir: str) -> None:
        """This rank's torch RNG state (CPU and, on GPU, the device's) under <ckpt_dir>/rng."""
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        os.makedirs(os.path.join(ckpt_dir, "rng"), exist_ok=True)
        torch.save(state, self._rng_file(ckpt_dir))

    @register(Dispatch.ALL)
    def load_rng(self, ckpt_dir: str) -> bool:
        """Restore this rank's RNG state if the checkpoint has one for it (not after a layout change)."""
        path = self._rng_file(ckpt_dir)
        if not os.path.exists(path):
            return False
        state = torch.load(path, weights_only=True)
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
        return True

    def _rng_file(self, ckpt_dir: str) -> str:
        return os.path.join(ckpt_dir, "rng", f"{self.group}_rank{self.rank}_of{self.world.world_size}.pt")

    @register(Dispatch.ALL)
    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
