"""Start-up validation of a config: the config stage of the check registry (rlsp.config.checks), run
in the driver before any worker has the run's config; it builds the run's one `ParallelLayout` on the way.

Checks here are arithmetic on config values (the `auto` keys also read the model's config.json and
the machine's memory, rlsp.config.auto); checks that need the model or the registries (head counts,
estimator names) are the preflight stage (rlsp/checks/preflight.py).
"""

from __future__ import annotations

from typing import Any

from rlsp.config.auto import AutoChoice
from rlsp.config.checks import CheckContext, run_checks
from rlsp.config.choices import DTYPE_NAMES, LOGGERS
from rlsp.config.layout import ParallelLayout
from rlsp.config.validate_core import GROUP_ESTIMATORS
from rlsp.config.validate_policy_loss import POLICY_LOSS_KEYS, policy_loss_users

# The legal-value lists live in rlsp.config.choices and the estimator groups in validate_core; named here too.
__all__ = ["DTYPE_NAMES", "GROUP_ESTIMATORS", "LOGGERS", "POLICY_LOSS_KEYS", "policy_loss_users", "validate_config"]


def validate_config(cfg: Any, auto: list[AutoChoice] | None = None, image_tokens: int | None = None) -> ParallelLayout:
    """Check `cfg` (RLSPConfig or an OmegaConf view of it), set its `auto` keys (rlsp.config.auto) and
    build its layout; raise one ValueError listing every problem. The `auto` decisions are appended to
    `auto` when given (none once `cfg` holds no `auto` value). `image_tokens`: the largest training row's image
    tokens where the caller counted them (rlsp.data.image_count.train_image_tokens; None: not counted)."""
    ctx = CheckContext(results={} if image_tokens is None else {"image_tokens": image_tokens})
    errors = run_checks(cfg, "config", ctx)
    if auto is not None:
        auto.extend(ctx.results.get("auto", []))
    if errors:
        raise ValueError("invalid rlsp config:\n  - " + "\n  - ".join(errors))
    assert ctx.layout is not None  # built by the "layout" check, which reports why when it cannot
    return ctx.layout
