"""The actor's policy-loss block `actor_rollout_ref.actor.policy_loss.*` (verl's nested spelling) and the
rewrite of the older flat spelling onto it. No torch import here.

`loss_mode` names a registered policy loss (rlsp/algos); the other keys are the settings of particular
losses, with verl's defaults. Which loss reads which key is `POLICY_LOSS_KEYS` in
rlsp/config/validate_policy_loss.py: a key set off its default for a loss that does not read it is refused
at start-up.

Two command-line spellings are rewritten before Hydra composes the config (`rlsp.main` and `rlsp.check`
both call :func:`rewrite_policy_loss_overrides`):

* `actor_rollout_ref.actor.policy_loss=<name>`: rlsp's earlier flat key, now `policy_loss.loss_mode=<name>`;
* `actor_rollout_ref.actor.tau_pos` / `tau_neg`: where verl declares SAPO's temperatures (on the actor);
  rlsp keeps them with the other loss settings, `policy_loss.tau_pos` / `policy_loss.tau_neg`.
"""

from __future__ import annotations

from dataclasses import dataclass

ACTOR = "actor_rollout_ref.actor"
POLICY_LOSS = f"{ACTOR}.policy_loss"


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"  # a registered policy loss: vanilla | cispo | gpg | gspo | geo_mean | sapo | ... (docs/algorithms.md)
    clip_cov_ratio: float = 0.0002  # clip_cov: fraction of tokens whose gradient is cut (verl's default)
    clip_cov_lb: float = 1.0  # clip_cov: lower bound of the covariance band tokens are drawn from
    clip_cov_ub: float = 5.0  # clip_cov: upper bound of that band
    kl_cov_ratio: float = 0.0002  # kl_cov: fraction of tokens (largest covariance) given the KL penalty
    ppo_kl_coef: float = 0.1  # kl_cov: coefficient of that penalty
    tau_pos: float = 1.0  # sapo: gate temperature for A > 0 (verl's actor.tau_pos; the paper's default)
    tau_neg: float = 1.05  # sapo: gate temperature for A <= 0 (verl's actor.tau_neg; the paper's default)


# Override keys rewritten onto the nested block, old spelling -> new spelling.
REWRITES = {
    POLICY_LOSS: f"{POLICY_LOSS}.loss_mode",
    f"{ACTOR}.tau_pos": f"{POLICY_LOSS}.tau_pos",
    f"{ACTOR}.tau_neg": f"{POLICY_LOSS}.tau_neg",
}


def rewrite_policy_loss_override(text: str) -> str:
    """One `key=value` override with an old spelling of a policy-loss key (:data:`REWRITES`) in the new one;
    any other override (a deletion `~key` too) unchanged. Hydra's prefixes (`+`, `++`, `~`) are kept."""
    prefix = text[: len(text) - len(text.lstrip("+~"))]
    key, sep, value = text[len(prefix):].partition("=")
    if key not in REWRITES or not sep:
        return text
    return f"{prefix}{REWRITES[key]}{sep}{value}"


def rewrite_policy_loss_overrides(overrides: list[str]) -> list[str]:
    """Every override through :func:`rewrite_policy_loss_override`, in order."""
    return [rewrite_policy_loss_override(text) for text in overrides]
