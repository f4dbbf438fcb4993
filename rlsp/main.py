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

The registered start-up checks run stage by stage (rlsp.config.checks: config, preflight, resume), exactly
those `python -m rlsp.check` runs; the config stage builds the run's one layout, handed to preflight and
the trainer. The resume stage (`rlsp.checks.resume_check`) decides what the run continues from and
refuses a checkpoint this command cannot load (another model, a critic added or dropped, a damaged file
with no whole checkpoint before it); a run that is already complete says so and exits 0. Once the config
stage passed and the run is not already complete, Ray and then the worker processes start on a thread of
their own while the preflight, data and resume checks run (rlsp.controller.ray_session: the checks import
torch and transformers here while the workers import them there); no worker gets the config before every
check passed, and a refused check stops those processes and that Ray before the exit. Exit codes: 0 done, 1 a fault during the run, 2 a refused config or resume,
130 Ctrl-C, 143 SIGTERM (both after one line naming the last complete checkpoint). torch, Ray and
transformers are imported only once a run gets that far, so a finished run (its newest
trainer_state.json is at trainer.total_training_steps) and a refused config answer in about a second.

The terminal shows rlsp's own lines, a progress bar and a closing summary; everything else
(third-party warnings, Ray and vLLM start-up output, worker output) goes to
<trainer.default_local_dir>/run.log.
"""

from __future__ import annotations

import os

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
from rlsp.config.describe import group_of_one_note
from rlsp.config.layout import ParallelLayout
from rlsp.config.schema_policy_loss import rewrite_policy_loss_overrides
from rlsp.config.store import register_schema
from rlsp.config.validate import validate_config
from rlsp.config.verl_compat import verl_key_notes
from rlsp.controller.ray_session import RayStart
from rlsp.controller.stopping import (
    SIGTERM_EXIT_CODE,
    catch_sigterm,
    ray_start_signals,
    signals_deferred,
    stop_exit_code,
)
from rlsp.data.image_count import train_image_tokens
from rlsp.run.checkpoint import finished_step, latest_checkpoint
from rlsp.utils.fast_exit import run_and_exit
from rlsp.utils.logging import RUN_LOG_NAME, get_logger, log_to_run_file

if TYPE_CHECKING:  # imported where a run starts (see the module docstring)
    from rlsp.checks.resume_check import ResumePlan
    from rlsp.trainer.ray_trainer import RayTrainer

log = get_logger("rlsp.main")
register_schema()


def run(cfg: DictConfig) -> list[dict[str, Any]]:
    """Validate (building the layout once), resolve assets, start workers, train; returns the per-step metrics."""
    from rlsp.checks.preflight import preflight

    layout = validate_config(cfg, image_tokens=train_image_tokens(cfg))  # a vision-language actor's auto rule
    cfg = preflight(cfg, layout)
    return train(cfg, layout)


def prepare(cfg: DictConfig, layout: ParallelLayout, plan: ResumePlan | None = None
            ) -> tuple[RayTrainer, str | None]:
    """Everything that can fail on the user's input, before any worker has the run's config: the datasets (they fix the run
    length when trainer.total_training_steps is unset), then the resume stage of the checks."""
    from rlsp.checks.resume_check import resume_plan
    from rlsp.trainer.ray_trainer import RayTrainer

    if layout.rollout is not None:  # a rollout pool of its own: generation overlapped with training
        from rlsp.trainer.async_trainer import AsyncTrainer

        trainer = AsyncTrainer(cfg, layout)
    else:
        trainer = RayTrainer(cfg, layout)
    plan = plan or resume_plan(cfg, layout)
    os.makedirs(cfg.trainer.default_local_dir, exist_ok=True)
    OmegaConf.save(cfg, os.path.join(cfg.trainer.default_local_dir, "config.yaml"), resolve=True)
    return trainer, plan.path


def train(cfg: DictConfig, layout: ParallelLayout, prepared: tuple[RayTrainer, str | None] | None = None,
          ray_start: RayStart | None = None) -> list[dict[str, Any]]:
    """Start the workers (once Ray is up: `ray_start`, begun while the checks ran, else started here), train,
    and stop everything this run started."""
    from rlsp.controller.worker_pools import PoolSettings  # ray: imported once a run gets this far

    trainer, resume = prepared or prepare(cfg, layout)
    log.info("run dir: %s | %s", cfg.trainer.default_local_dir, layout.describe())
    ray_start = ray_start or RayStart(cfg, layout)
    clean = False
    try:
        with ray_start_signals():  # SIGTERM while Ray starts: exit 143 with its line, as later on
            waited = ray_start.wait()
            catch_sigterm(trainer.stop)  # with the trainer's stop request now: trainer.save_on_preempt
        trainer.startup.update({"startup/ray_init_s": ray_start.seconds, "startup/ray_wait_s": waited})
        trainer.start_workers(ray_start.take_pools(PoolSettings.of(cfg)))
        if resume:
            trainer.load_checkpoint(resume)
        history = trainer.fit()
        clean = True
        return history
    finally:
        # After a fault or Ctrl-C the workers may be stuck in a collective: kill them, don't wait.
        trainer.shutdown(graceful=clean)
        ray_start.stop()  # a private Ray stops; a joined cluster is only left; a caller's Ray (tests) stays
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
        ray_start = RayStart(cfg, layout)  # Ray's processes come up while the checks run
        try:
            with signals_deferred():  # a signal inside an import can break the module: after the checks
                prepared = _prepare_checked(cfg, layout)
            if (done := finished_step(cfg)) is not None:  # a run length from the dataset is known only now
                log.info("the run is already complete at step %d (trainer.total_training_steps=%d)", done,
                         cfg.trainer.total_training_steps)
                return
            train(cfg, layout, prepared, ray_start)
        finally:
            ray_start.stop()  # after a refused check or a signal (train stops it itself)
    except KeyboardInterrupt as exc:
        raise stopped_exit(cfg, exc) from None
    except Exception as exc:
        traceback.print_exc()  # into the run's log file
        lines = str(exc).strip().splitlines() or [""]
        more = f" [{len(lines) - 3} more lines]" if len(lines) > 3 else ""
        log.error("run failed: %s: %s%s\n(traceback in %s)", type(exc).__name__, "\n".join(lines[:3]), more,
                  os.path.join(cfg.trainer.default_local_dir, RUN_LOG_NAME))
        raise SystemExit(1) from None


def stopped_exit(cfg: DictConfig, exc: KeyboardInterrupt) -> SystemExit:
    """The exit of a run stopped by a signal: one line naming the last complete checkpoint, code 143 for
    SIGTERM and 130 for Ctrl-C, decided by the signal that arrived (`stop_exit_code`)."""
    latest = latest_checkpoint(cfg.trainer.default_local_dir)
    where = f"last complete checkpoint: {latest} (continue with the same command)" if latest else "no checkpoint was written"
    code = stop_exit_code(exc)
    log.error("%s; %s", "terminated (SIGTERM)" if code == SIGTERM_EXIT_CODE else "interrupted", where)
    return SystemExit(code)


def _prepare_checked(cfg: DictConfig, layout: ParallelLayout) -> tuple[RayTrainer, str | None]:
    """Preflight, the resume checks and the datasets; a user error exits 2 before any worker has the config
    (the worker processes that started meanwhile are stopped)."""
    from rlsp.checks.preflight import preflight

    try:
        preflight(cfg, layout)  # resolves built-in assets in place
        return prepare(cfg, layout)
    except ValueError as exc:
        # Config, data and resume errors are for the user, not a traceback; no worker has started yet.
        log.error("%s", exc)
        raise SystemExit(2) from None


@hydra.main(config_path=CONFIG_DIR, config_name=DEFAULT_CONFIG, version_base=None)
def main(cfg: DictConfig) -> None:
    auto: list[AutoChoice] = []
    try:
        layout = validate_config(cfg, auto, train_image_tokens(cfg))  # image tokens: the auto rules' data
    except ValueError as exc:
        log.error("%s", exc)
        raise SystemExit(2) from None
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # worker output goes to a file: no colour codes
    with log_to_run_file(os.path.join(cfg.trainer.default_local_dir, RUN_LOG_NAME)):
        for choice in auto:  # once, at start-up: what rlsp chose where the command left `auto`
            log.info("auto: %s", choice.line())
        if note := group_of_one_note(cfg):  # rollout.n=1 with a group estimator: said, never silent
            log.info("%s", note)
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
