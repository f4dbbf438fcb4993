"""Rollout-correction bypass mode (`algorithm.rollout_correction.bypass_mode` / `loss_type`, verl's keys):
the start-up checks and the policy loss the actor runs. No torch import here.

With bypass_mode=true the rollout engine's logprobs are the old policy (no trainer pass) and the policy
loss is verl's "bypass_mode" (rlsp/algos/bypass.py), which applies the rollout correction inside the
loss from the current logprobs. verl silently replaces whatever `policy_loss.loss_mode` says by that
loss; rlsp refuses a loss_mode other than vanilla instead, and every other combination that would be
ignored. With loss_type=ppo_clip the clipped ratio already is the importance weight: `rollout_is` weights are
then reported (rollout_corr/rollout_is_mean), not applied, as verl computes them for metrics only.
"""

from __future__ import annotations

from typing import Any

from rlsp.config.choices import BYPASS_LOSS_TYPES
from rlsp.config.validate_policy_loss import POLICY_LOSS_KEY_DEFAULTS, _at_default

RC = "algorithm.rollout_correction."
CLIP_KEYS = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c")  # vanilla's, which reinforce does not read


def check_bypass_mode(cfg: Any, errors: list[str]) -> None:
    """Every bypass_mode / loss_type combination that cannot do what it says, collected into `errors`."""
    rc, actor = cfg.algorithm.rollout_correction, cfg.actor_rollout_ref.actor
    mode = actor.policy_loss.loss_mode
    if rc.loss_type not in BYPASS_LOSS_TYPES:
        errors.append(f"{RC}loss_type={rc.loss_type!r} is not supported; legal values: {list(BYPASS_LOSS_TYPES)}")
    if not rc.bypass_mode:
        if rc.loss_type != "ppo_clip":
            errors.append(f"{RC}loss_type={rc.loss_type!r} picks the loss of bypass mode and has no effect without "
                          f"{RC}bypass_mode=true; set it, or leave loss_type at 'ppo_clip'")
        if mode == "bypass_mode":
            errors.append(f"actor_rollout_ref.actor.policy_loss.loss_mode='bypass_mode' is chosen by {RC}bypass_mode=true "
                          f"(with {RC}loss_type); set that instead")
        return
    if mode != "vanilla":
        errors.append(f"{RC}bypass_mode=true replaces the policy loss by {RC}loss_type's (ppo_clip: vanilla's PPO clip; "
                      f"reinforce), so actor_rollout_ref.actor.policy_loss.loss_mode={mode!r} would be ignored; leave it "
                      f"at 'vanilla', or run {mode!r} against the rollout logprobs with "
                      "async_training.use_rollout_log_probs=true and bypass_mode=false")
    a = cfg.async_training
    if a.use_rollout_log_probs or a.compute_prox_log_prob:
        errors.append(f"{RC}bypass_mode=true already takes the rollout logprobs as the old policy; leave async_training."
                      "use_rollout_log_probs and async_training.compute_prox_log_prob false")
    if rc.loss_type == "reinforce":
        for key in CLIP_KEYS:
            if not _at_default(key, actor[key]):
                errors.append(f"actor_rollout_ref.actor.{key}={actor[key]} has no effect with {RC}loss_type='reinforce' "
                              f"(no ratio clip); leave it at {POLICY_LOSS_KEY_DEFAULTS[key]} or use loss_type=ppo_clip")

