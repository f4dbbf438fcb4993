"""Start-up check of FSDP offload: `fsdp_config.param_offload`, `optimizer_offload`, `offload_policy`.

verl has two mechanisms: `param_offload` / `optimizer_offload` move the parameter shards / the
optimizer state to host memory between calls (and back for each call), and, with FSDP2,
`offload_policy` hands FSDP2 its `CPUOffloadPolicy` (parameters, gradients and optimizer state in
host memory throughout, optimizer step on the CPU), which supersedes the other two. rlsp has the
FSDP2 policy only, and maps the keys onto it as follows (rlsp.engine.fsdp_offload):

* offload_policy=true: the policy, whatever the other two say (verl ignores them then too);
* param_offload=true: the policy. FSDP2 creates the optimizer state next to its parameters, so for a
  trainable role (actor, critic) the optimizer state goes to host memory with them whatever
  optimizer_offload says (false is its default; the log says so once); optimizer_offload=true
  without param_offload=true asks for the state alone, which FSDP2 cannot do: refused with that
  reason instead of being half honoured;
* frozen roles (reference, reward model) have no optimizer: optimizer_offload=true is refused;
* with LoRA the reference runs on the actor's engine (adapters off), as in verl: its own param_offload /
  offload_policy have no effect (accepted; the log says so once at start-up and `rlsp.check` notes it);
  the actor's fsdp_config.* offloads the shared base weights.
On a CPU run every combination accepted here is applied and has no effect (logged once per role).
"""

from __future__ import annotations

from typing import Any

from rlsp.config.layout import ParallelLayout


def _check_role(prefix: str, fsdp: Any, trainable: bool, errors: list[str]) -> None:
    p, o, policy = bool(fsdp.param_offload), bool(fsdp.optimizer_offload), bool(fsdp.offload_policy)
    if not trainable and o:
        errors.append(f"{prefix}.optimizer_offload=true is not supported: this role is frozen and has no optimizer "
                      f"state; legal values: [false] (offload its parameters with {prefix}.param_offload=true)")
    elif trainable and o and not (p or policy):
        errors.append(
            f"{prefix}.optimizer_offload=true without {prefix}.param_offload=true is not supported: FSDP2 keeps the "
            "optimizer state next to its parameters, so rlsp offloads both together (CPUOffloadPolicy) or neither; "
            f"set {prefix}.param_offload=true as well (or offload_policy=true)")


def check_offload(cfg: Any, layout: ParallelLayout | None, errors: list[str]) -> None:
    """The offload keys of every role that builds an engine (see the module docstring)."""
    arr = cfg.actor_rollout_ref
    _check_role("actor_rollout_ref.actor.fsdp_config", arr.actor.fsdp_config, True, errors)
    _check_role("actor_rollout_ref.ref.fsdp_config", arr.ref.fsdp_config, False, errors)
    if layout is not None and layout.critic is not None:
        _check_role("critic.model.fsdp_config", cfg.critic.model.fsdp_config, True, errors)
    if cfg.reward_model.enable:
        _check_role("reward_model.model.fsdp_config", cfg.reward_model.model.fsdp_config, False, errors)
