"""The run's Ray: which one (a private local Ray or a cluster to join), starting it, and stopping it.

`RayStart` runs `init_ray` on a thread of its own and then starts the training pools' processes
(rlsp.controller.worker_pools: no torch in the driver for that), so that a private Ray's processes (GCS,
raylet, agents: ~2 s on 2 cores) come up and the workers import torch and transformers (~4 s of CPU
each) while the driver's start-up checks import the same on the main thread. On a small run these
phases, one after the other, were most of what a user waited for before the first step. The workers get
the run's config only once every check passed (`init_workers`); a refused check (or a signal meanwhile)
waits for `ray.init` to return, which cannot be cut short, and stops the pools and that Ray again
(`RayStart.stop`).

A cluster to join (`trainer.ray_address`, or the one `ray job submit` gave the driver) is joined as
before, on the main thread once the checks passed (`wait`): with a job's working directory Ray's runtime
env replaces the driver's current directory while it connects, which the checks' imports read at the same
time (`os.getcwd()` failed in them).

The thread lives until `stop`: Ray's processes die with the thread that started them (PR_SET_PDEATHSIG).
Ray's SIGTERM handler (a bare `sys.exit(15)`) is installed only by a `ray.init` on the main thread; on
this thread Ray says so in run.log and the run's own handler (rlsp.controller.stopping) stays. Signals are
delivered to the main thread alone, so one that arrives while Ray starts interrupts the checks or the wait
for Ray there, never Ray's process start-up (where Python could drop its exception).
"""

from __future__ import annotations

import copy
import os
import secrets
import shlex
import shutil
import threading
import time
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from rlsp.config.machine import machine_facts
from rlsp.controller.ray_start import without_api_server
from rlsp.controller.stopping import kill_ray_sessions, ray_in_own_session, stop_autoscaler_monitor
from rlsp.utils.logging import get_logger

if TYPE_CHECKING:
    from rlsp.config.layout import ParallelLayout
    from rlsp.controller.worker_pools import PoolSettings, StartedPool

log = get_logger("rlsp.main")
# Ray's job supervisor sets this (with RAY_ADDRESS) on every driver it starts for `ray job submit`.
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def ray_address(setting: str | None) -> str | None:
    """The cluster to join for `trainer.ray_address=setting`, or None for a private local Ray."""
    if setting in (None, "", "local"):
        submitted = RAY_JOB_ENV in os.environ and os.environ.get("RAY_ADDRESS")
        return os.environ["RAY_ADDRESS"] if submitted else None
    return setting


def private_auth_token() -> None:
    """A Ray started here authenticates every client with a token. Left to itself it writes a new one to
    ~/.ray/auth_token with the umask's mode (0644: readable by every local user), where it stays after the
    run. Unless a token or mode is configured (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, RAY_AUTH_MODE), this
    run makes its own and passes it in the environment, which the Ray processes it starts inherit and only
    this user can read (/proc/<pid>/environ is 0400): nothing is written to disk."""
    if not any(key in os.environ for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE")):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


def private_ray_resources(cfg: DictConfig, world_size: int) -> dict[str, int]:
    """num_cpus and object_store_memory of the private local Ray: verl's ray_kwargs.ray_init where set."""
    ray_init = cfg.ray_kwargs.ray_init  # start-up validation checks the values
    # the device type without importing torch (Ray may start on a thread while the main one imports it)
    if ray_init.num_cpus is not None and machine_facts(cfg.trainer.device, 1).device == "cpu":
        # CPU workers each reserve cores // workers: fewer Ray CPUs would leave them unplaced forever.
        raise RuntimeError(f"ray_kwargs.ray_init.num_cpus={ray_init.num_cpus} on a CPU run: CPU workers share this "
                           "machine's cores equally (Ray needs all of them); leave it null")
    return {"num_cpus": ray_init.num_cpus or max(os.cpu_count() or 1, world_size),
            "object_store_memory": ray_init.object_store_memory or 512 * 1024**2}


def job_runtime_env(cfg: DictConfig) -> dict[str, Any]:
    """Ray's runtime_env of the run's job from verl's ray_kwargs.ray_init.runtime_env: env_vars (as strings) and the
    workers' py_executable where set. Every Ray process of the job gets it; an actor's own env_vars (rlsp's worker
    environment) are merged over the job's, its other fields (the launcher) inherited."""
    env = cfg.ray_kwargs.ray_init.runtime_env
    runtime_env: dict[str, Any] = {}
    if env.env_vars:
        runtime_env["env_vars"] = {str(k): str(v) for k, v in env.env_vars.items()}
    if env.py_executable is not None:
        runtime_env["py_executable"] = str(env.py_executable)
    return runtime_env


def launcher_problem(cfg: DictConfig) -> str | None:
    """Why a private Ray could not start its workers through ray_kwargs.ray_init.runtime_env.py_executable (its
    program is not on this machine), or None. A joined cluster's nodes are not this machine: not checked."""
    launcher = cfg.ray_kwargs.ray_init.runtime_env.py_executable
    if launcher is None or ray_address(cfg.trainer.ray_address) is not None:
        return None
    program = shlex.split(str(launcher))[0]
    found = os.access(program, os.X_OK) if os.sep in program else shutil.which(program) is not None
    if found:
        return None
    return (f"ray_kwargs.ray_init.runtime_env.py_executable={launcher!r}: {program!r} is not "
            f"{'an executable file' if os.sep in program else 'a program on this PATH'}, so the private Ray could "
            "not start any worker process through it; install it, give its full path, or leave py_executable null "
            "(the workers run this Python)")


def init_ray(cfg: DictConfig, world_size: int) -> str | None:
    """Start or join Ray (see rlsp.main's docstring); the line that says which (for the caller to log), or
    None if this process was already connected."""
    import ray

    if ray.is_initialized():
        return None
    address = ray_address(cfg.trainer.ray_address)
    if address is None:
        if os.environ.get("RAY_ADDRESS"):
            log.info("RAY_ADDRESS=%s is ignored: trainer.ray_address is unset, so this run starts a private "
                     "local Ray (trainer.ray_address=auto joins that cluster)", os.environ["RAY_ADDRESS"])
        private_auth_token()
        # address="local" makes Ray start a new instance even if it could find another one.
        # No pre-started idle workers: each rlsp worker carries its own runtime env (rank, threads), so
        # Ray could never hand one of them out; they only took CPU while the real workers imported torch.
        # In a session of its own, Ray outlives a signal to this job's whole process group (Slurm's
        # scancel) long enough for the driver to stop the run cleanly (see rlsp.controller.stopping).
        with ray_in_own_session(), without_api_server():
            ray.init(address="local", **private_ray_resources(cfg, world_size), include_dashboard=False,
                     log_to_driver=True, runtime_env=job_runtime_env(cfg) or None,
                     _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False})
        return f"started a private local Ray ({ray.get_runtime_context().gcs_address})"
    try:
        ray.init(address=address, log_to_driver=True, runtime_env=job_runtime_env(cfg) or None)
    except ConnectionError as exc:
        raise RuntimeError(f"trainer.ray_address={cfg.trainer.ray_address!r}: no Ray cluster to join ({exc}). "
                           "Start one with `ray start --head`, or leave trainer.ray_address unset for a "
                           "private local Ray.") from None
    except ValueError as exc:  # Ray's refusal to merge ray_kwargs' runtime_env with a submitted job's
        if "runtime env" not in str(exc):
            raise
        raise RuntimeError(f"ray_kwargs.ray_init.runtime_env={job_runtime_env(cfg)} sets what the submitted job's "
                           f"runtime env already sets ({exc}); set each field or variable in one place") from None
    return (f"joined the Ray cluster at {ray.get_runtime_context().gcs_address}: "
            f"{len([n for n in ray.nodes() if n['Alive']])} nodes, {ray.cluster_resources()}")


def stop_ray() -> None:
    """Stop the private Ray this process started (its autoscaler monitor first, then what is left in its
    sessions), or only disconnect from a joined cluster (flushing worker output)."""
    import ray

    stop_autoscaler_monitor()
    ray.shutdown()
    kill_ray_sessions()  # a private Ray's stragglers (a run stopped while Ray started)


class RayStart:
    """`init_ray` on a thread of its own, begun at construction, then the training pools' processes (see the
    module docstring). `wait()` returns once both are under way, raising what failed, and logs which Ray it
    is; `take_pools(settings)` hands the pools over; `stop()` stops what was not handed over and the Ray this
    start brought up. A process already connected to Ray (tests) keeps its Ray."""

    def __init__(self, cfg: DictConfig, layout: ParallelLayout) -> None:
        import ray  # noqa: F401 -- on the main thread, before the start thread runs

        from rlsp.controller.worker_pools import PoolSettings, start_training_pools

        self.owned = False  # this start connected the process: `stop` ends its Ray
        self.seconds = 0.0  # how long ray.init took (alongside the checks)
        self._cfg = copy.deepcopy(cfg)  # the main thread goes on resolving its own copy meanwhile
        self._layout = layout
        self._settings = PoolSettings.guess(cfg)  # no torch: checked against torch's answer by `take_pools`
        self._start_pools = start_training_pools
        self._error: BaseException | None = None
        self._started: str | None = None  # init_ray's line: logged by `wait`, never after a refused check
        self._pools: list[StartedPool] = []
        self._up = threading.Event()
        self._release = threading.Event()
        self._thread: threading.Thread | None = None
        if ray_address(cfg.trainer.ray_address) is None:  # a private Ray; a cluster is joined by `wait`
            self._thread = threading.Thread(target=self._start, name="rlsp-ray-start", daemon=True)
            self._thread.start()

    def _start(self) -> None:
        self._connect_and_start_pools()
        # Ray starts its processes with PR_SET_PDEATHSIG (they die with their parent), and Linux's parent
        # is the thread that started them: this thread outlives them, until `stop` has stopped Ray.
        self._release.wait()

    def _connect_and_start_pools(self) -> None:
        t0 = time.perf_counter()
        try:
            import ray

            self.owned = not ray.is_initialized()  # set before: a failed start still has processes to stop
            self._started = init_ray(self._cfg, self._layout.total_workers)
            self.seconds = time.perf_counter() - t0
            self._pools = self._start_pools(self._settings, self._layout)
        except BaseException as exc:  # noqa: BLE001 -- raised again by `wait` on the main thread
            self._error = exc
        self._up.set()

    def wait(self) -> float:
        """Block until Ray is up and the pools' processes are starting; the seconds waited here (what the
        checks did not hide)."""
        t0 = time.perf_counter()
        if self._thread is None and not self._up.is_set():
            self._connect_and_start_pools()  # joining a cluster: here, once the checks passed
        self._up.wait()
        if self._error is not None:
            raise self._error
        if self._started:
            log.info("%s", self._started)
            self._started = None
        return time.perf_counter() - t0

    def take_pools(self, settings: PoolSettings) -> list[StartedPool] | None:
        """The started pools (policy, then a critic pool of its own), now the caller's to stop; None (and
        the pools stopped) where `settings`, read once the checks passed, differ from those they started
        with (`trainer.device=auto` guessed another device than torch sees)."""
        pools, self._pools = self._pools, []
        if pools and settings != self._settings:
            log.info("the worker processes started for %s are stopped: this run computes on %s", self._settings,
                     settings)
            for pool in pools:
                pool.stop()
            return None
        return pools or None

    def stop(self) -> None:
        """Stop the pools not taken and the Ray this start brought up (idempotent); a process that was
        already connected keeps its Ray."""
        if self._thread is None and not self._up.is_set():
            return  # a cluster not joined yet: nothing started
        self._up.wait()
        try:
            for pool in self._pools:
                pool.stop()
            self._pools = []
            if self.owned:
                self.owned = False
                stop_ray()
        finally:
            self._release.set()
            if self._thread is not None:
                self._thread.join()
