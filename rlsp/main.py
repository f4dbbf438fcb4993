"""Entry point: `python -m rlsp.main [hydra overrides]`.

With no arguments it runs the tiny CPU GRPO demo (built-in tiny Qwen2 + arithmetic task) with 2
workers. Where Ray comes from is `trainer.ray_address`:

    unset (or local)  a private local Ray for this run alone, listening on 127.0.0.1 only, whatever else
                      runs on the machine (another Ray, a stale /tmp/ray address file, RAY_ADDRESS in the
                      shell); it stops when the run ends. It starts no dashboard and no API server
                      (rlsp.controller.ray_start); its autoscaler monitor is stopped first at the end. A
                      driver submitted with `ray job submit` is the exception: it joins the cluster it
                      was submitted to (Ray sets RAY_ADDRESS for it).
    auto              join the running cluster Ray finds: RAY_ADDRESS, else the last `ray start` here.
    <host>:<port>     join that cluster (`ray://<host>:<port>` goes through Ray Client).

Before Ray starts, the registered start-up checks run stage by stage (rlsp.config.checks: config,
preflight, resume), exactly those `python -m rlsp.check` runs; the config stage builds the run's one
layout, handed to preflight and the trainer. The resume stage (`rlsp.trainer.resume_check`) decides what the run continues from and refuses a
checkpoint this command cannot load (another model, a critic added or dropped, a damaged file with no
whole checkpoint before it); a run that is already complete says so and exits 0. Exit codes: 0 done,
1 a fault during the run, 2 a refused config or resume, 130 Ctrl-C, 143 SIGTERM (both after one line
naming the last complete checkpoint). torch, Ray and transformers are imported only once a run gets
that far, so a finished run (its newest trainer_state.json is at trainer.total_training_steps) and a
refused config answer in about a second.

The terminal shows rlsp's own lines, a progress bar and a closing summary; everything else
(third-party warnings, Ray and vLLM start-up output, worker output) goes to
<trainer.default_local_dir>/run.log.
"""

from __future__ import annotations

import os
import secrets
import time

# Ray reads this when it is imported. Off, a Ray that rlsp starts itself takes 127.0.0.1 as its node
# address, so every service it opens listens on loopback only. Joining a cluster is unaffected: the
# driver then attaches to the Ray node it runs on. (The name is Ray's; off means "single-node only".)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import sys
import traceback
from typing import TYPE_CHECKING, Any

import hydra
from omegaconf import DictConfig, OmegaConf

from rlsp.config.auto import AutoChoice
from rlsp.config.compose import CONFIG_DIR, DEFAULT_CONFIG, refused_overrides, verl_argv
from rlsp.config.layout import ParallelLayout
from rlsp.config.schema_policy_loss import rewrite_policy_loss_overrides
from rlsp.config.store import register_schema
from rlsp.config.validate import validate_config
from rlsp.config.verl_compat import verl_key_notes
from rlsp.controller.ray_start import without_api_server
from rlsp.trainer.checkpoint import finished_step, latest_checkpoint
from rlsp.trainer.stopping import (
    SIGTERM_EXIT_CODE,
    Terminated,
    catch_sigterm,
    kill_ray_sessions,
    ray_in_own_session,
    ray_start_signals,
    stop_autoscaler_monitor,
)
from rlsp.utils.fast_exit import run_and_exit
from rlsp.utils.logging import RUN_LOG_NAME, get_logger, log_to_run_file

if TYPE_CHECKING:  # imported where a run starts (see the module docstring)
    from rlsp.trainer.ray_trainer import RayTrainer
    from rlsp.trainer.resume_check import ResumePlan

log = get_logger("rlsp.main")
register_schema()
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


def _private_ray_resources(cfg: DictConfig, world_size: int) -> dict[str, int]:
    """num_cpus and object_store_memory of the private local Ray: verl's ray_kwargs.ray_init where set."""
    from rlsp.utils.device import target_device_type

    ray_init = cfg.ray_kwargs.ray_init  # start-up validation checks the values
    if ray_init.num_cpus is not None and target_device_type(cfg.trainer.device) == "cpu":
        # CPU workers each reserve cores // workers: fewer Ray CPUs would leave them unplaced forever.
        raise RuntimeError(f"ray_kwargs.ray_init.num_cpus={ray_init.num_cpus} on a CPU run: CPU workers share this "
                           "machine's cores equally (Ray needs all of them); leave it null")
    return {"num_cpus": ray_init.num_cpus or max(os.cpu_count() or 1, world_size),
            "object_store_memory": ray_init.object_store_memory or 512 * 1024**2}


def _init_ray(cfg: DictConfig, world_size: int) -> bool:
    """Start or join Ray (see the module docstring); False if this process was already connected."""
    import ray

    if ray.is_initialized():
        return False
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
        # scancel) long enough for the driver to stop the run cleanly (see rlsp.trainer.stopping).
        with ray_in_own_session(), without_api_server():
            ray.init(address="local", **_private_ray_resources(cfg, world_size), include_dashboard=False,
                     log_to_driver=True,
                     _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False})
        log.info("started a private local Ray (%s)", ray.get_runtime_context().gcs_address)
        return True
    try:
        ray.init(address=address, log_to_driver=True)
    except ConnectionError as exc:
        raise RuntimeError(f"trainer.ray_address={cfg.trainer.ray_address!r}: no Ray cluster to join ({exc}). "
                           "Start one with `ray start --head`, or leave trainer.ray_address unset for a "
                           "private local Ray.") from None
    log.info("joined the Ray cluster at %s: %d nodes, %s", ray.get_runtime_context().gcs_address,
             len([n for n in ray.nodes() if n["Alive"]]), ray.cluster_resources())
    return True


def run(cfg: DictConfig) -> list[dict[str, Any]]:
    """Validate (building the layout once), resolve assets, start workers, train; returns the per-step metrics."""
    from rlsp.trainer.preflight import preflight

    layout = validate_config(cfg)
    cfg = preflight(cfg, layout)
    return train(cfg, layout)


def prepare(cfg: DictConfig, layout: ParallelLayout, plan: ResumePlan | None = None
            ) -> tuple[RayTrainer, str | None]:
    """Everything that can fail on the user's input, before Ray starts: the datasets (they fix the run
    length when trainer.total_training_steps is unset), then the resume stage of the checks."""
    from rlsp.trainer.ray_trainer import RayTrainer
    from rlsp.trainer.resume_check import resume_plan

    if layout.rollout is not None:  # a rollout pool of its own: generation overlapped with training
        from rlsp.trainer.async_trainer import AsyncTrainer

        trainer = AsyncTrainer(cfg, layout)
    else:
        trainer = RayTrainer(cfg, layout)
    plan = plan or resume_plan(cfg, layout)
    os.makedirs(cfg.trainer.default_local_dir, exist_ok=True)
    OmegaConf.save(cfg, os.path.join(cfg.trainer.default_local_dir, "config.yaml"), resolve=True)
    return trainer, plan.path


def train(cfg: DictConfig, layout: ParallelLayout, prepared: tuple[RayTrainer, str | None] | None = None
          ) -> list[dict[str, Any]]:
    import ray

    trainer, resume = prepared or prepare(cfg, layout)
    log.info("run dir: %s | %s", cfg.trainer.default_local_dir, layout.describe())
    t0 = time.perf_counter()
    connected_here = not ray.is_initialized()  # else the caller's Ray (tests): left as it is
    clean = False
    try:
        with ray_start_signals():  # SIGTERM while Ray starts: exit 143 with its line, as later on
            _init_ray(cfg, layout.total_workers)
            catch_sigterm(trainer)  # again: ray.init replaced the handler with a silent sys.exit(15)
        trainer.startup["startup/ray_init_s"] = time.perf_counter() - t0
        trainer.start_workers()
        if resume:
            trainer.load_checkpoint(resume)
        history = trainer.fit()
        clean = True
        return history
    finally:
        # After a fault or Ctrl-C the workers may be stuck in a collective: kill them, don't wait.
        trainer.shutdown(graceful=clean)
        if connected_here:  # stops a private Ray; from a cluster, only disconnects (flushing worker output)
            stop_autoscaler_monitor()
            ray.shutdown()
            kill_ray_sessions()  # a private Ray's stragglers (a run stopped while Ray started)
        trainer.wait_outputs()  # the reward plot, drawn meanwhile


def _run_logged(cfg: DictConfig, layout: ParallelLayout) -> None:
    """`main` once the run's log file holds stdout/stderr: user errors exit 2, Ctrl-C 130, SIGTERM 143,
    faults 1."""
    catch_sigterm()
    try:
        if (done := finished_step(cfg)) is not None:
            log.info("the run is already complete at step %d (trainer.total_training_steps=%d)", done,
                     cfg.trainer.total_training_steps)
            return
        prepared = _prepare_checked(cfg, layout)
        if (done := finished_step(cfg)) is not None:  # a run length from the dataset is known only now
            log.info("the run is already complete at step %d (trainer.total_training_steps=%d)", done,
                     cfg.trainer.total_training_steps)
            return
        train(cfg, layout, prepared)
    except KeyboardInterrupt as exc:
        latest = latest_checkpoint(cfg.trainer.default_local_dir)
        where = f"last complete checkpoint: {latest} (continue with the same command)" if latest else "no checkpoint was written"
        terminated = isinstance(exc, Terminated)
        log.error("%s; %s", "terminated (SIGTERM)" if terminated else "interrupted", where)
        raise SystemExit(SIGTERM_EXIT_CODE if terminated else 130) from None
    except Exception as exc:
        traceback.print_exc()  # into the run's log file
        lines = str(exc).strip().splitlines() or [""]
        more = f" [{len(lines) - 3} more lines]" if len(lines) > 3 else ""
        log.error("run failed: %s: %s%s\n(traceback in %s)", type(exc).__name__, "\n".join(lines[:3]), more,
                  os.path.join(cfg.trainer.default_local_dir, RUN_LOG_NAME))
        raise SystemExit(1) from None


def _prepare_checked(cfg: DictConfig, layout: ParallelLayout) -> tuple[RayTrainer, str | None]:
    """Preflight, the resume checks and the datasets; a user error exits 2 before Ray starts."""
    from rlsp.trainer.preflight import preflight

    try:
        preflight(cfg, layout)  # resolves built-in assets in place
        return prepare(cfg, layout)
    except ValueError as exc:
        # Config, data and resume errors are for the user, not a traceback; nothing has started yet.
        log.error("%s", exc)
        raise SystemExit(2) from None


@hydra.main(config_path=CONFIG_DIR, config_name=DEFAULT_CONFIG, version_base=None)
def main(cfg: DictConfig) -> None:
    auto: list[AutoChoice] = []
    try:
        layout = validate_config(cfg, auto)
    except ValueError as exc:
        log.error("%s", exc)
        raise SystemExit(2) from None
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # worker output goes to a file: no colour codes
    with log_to_run_file(os.path.join(cfg.trainer.default_local_dir, RUN_LOG_NAME)):
        for choice in auto:  # once, at start-up: what rlsp chose where the command left `auto`
            log.info("auto: %s", choice.line())
        _run_logged(cfg, layout)


def refuse_unsupported_overrides(argv: list[str]) -> None:
    """Exit 2 naming every verl key of the command that rlsp refuses, with the reason, before Hydra (whose
    own error would only say that the key is not in the schema); else log what rlsp does with each verl key
    of the command that it handles its own way (as rlsp.check prints it)."""
    refused = refused_overrides([a for a in argv if "=" in a and not a.startswith("-")])
    if refused:
        log.error("invalid rlsp config:\n  - %s", "\n  - ".join(refused))
        raise SystemExit(2)
    if notes := verl_key_notes(argv):  # verl keys rlsp handles its own way: said once, never silently
        log.info("verl keys of this command:\n  %s", "\n  ".join(notes))


def cli() -> None:
    """`python -m rlsp.main ...`: the command line's spellings, then `main` (Hydra)."""
    sys.argv[1:] = rewrite_policy_loss_overrides(sys.argv[1:])  # old policy-loss spellings -> the nested block
    sys.argv[1:] = verl_argv(sys.argv[1:])  # verl's other key spellings -> rlsp's keys
    refuse_unsupported_overrides(sys.argv[1:])
    main()


if __name__ == "__main__":
    run_and_exit(cli)  # exits with main's code once done, without the interpreter's ~1.5 s teardown
