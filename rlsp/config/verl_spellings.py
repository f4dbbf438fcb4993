"""verl's other spellings of keys rlsp declares once: rewritten on the command line before Hydra composes it.

verl has moved keys between its releases (the critic's FSDP block from `critic.model.fsdp_config` to
`critic.fsdp`, the reward model from `reward_model` to `reward.reward_model`, the reward manager's arguments
from `reward_model.reward_kwargs` to `reward.reward_kwargs`, a role's Ulysses degree into its engine block
`fsdp_config`, ...). rlsp keeps one key per setting; both entry points (rlsp.main and rlsp.check, through
rlsp.config.compose) rewrite each override spelled the other way onto it, so both verl generations' commands
compose. Setting one setting under two spellings with different values is refused (one source of truth).

Renames that need the key to be undeclared in the schema live here; verl spellings the schema declares as
keys of their own (`custom_reward_function.*`, `optim.clip_grad`) are mapped after composing
(rlsp.config.verl_compat.ALIASES).
"""

from __future__ import annotations

# verl prefix -> rlsp prefix (applied first).
PREFIX_RENAMES = {
    "critic.fsdp.": "critic.model.fsdp_config.",  # newer verl: the critic's FSDP engine block
    "reward.reward_model.": "reward_model.",  # newer verl: the reward model under `reward`
    "reward.custom_reward_function.": "custom_reward_function.",  # newer verl: the custom function under `reward`
    "reward_model.reward_kwargs.": "reward.reward_kwargs.",  # older verl: the reward manager's arguments
}
_ROLES = {"actor_rollout_ref.actor.fsdp_config.": "actor_rollout_ref.actor.",
          "actor_rollout_ref.ref.fsdp_config.": "actor_rollout_ref.ref.", "critic.model.fsdp_config.": "critic."}
# verl key -> rlsp key (applied after the prefixes).
RENAMES = {
    "reward_model.model_path": "reward_model.model.path",  # newer verl's reward.reward_model.model_path
    "reward.num_workers": "reward_model.num_workers",  # verl 0.9's reward-loop workers (rule scoring processes)
    "actor_rollout_ref.actor.grad_clip": "actor_rollout_ref.actor.optim.grad_clip",  # verl's deprecated spelling
    "critic.grad_clip": "critic.optim.grad_clip",
    "actor_rollout_ref.model.torch_dtype": "actor_rollout_ref.model.dtype",  # HF's name for the model's dtype
    "actor_rollout_ref.actor.tau_pos": "actor_rollout_ref.actor.policy_loss.tau_pos",  # SAPO's temperatures
    "actor_rollout_ref.actor.tau_neg": "actor_rollout_ref.actor.policy_loss.tau_neg",
    # A role's engine block (verl's FSDPEngineConfig) repeats role settings that rlsp keeps on the role.
    **{f"{block}{key}": f"{role}{key}" for block, role in _ROLES.items()
       for key in ("ulysses_sequence_parallel_size", "strategy")},
    **{f"{block}{key}": f"{role}{key}" for block, role in list(_ROLES.items())[:2]
       for key in ("entropy_from_logits_with_chunking", "entropy_checkpointing", "use_torch_compile")},
    # verl's FSDP-Turbo engine spells the expert-parallel degree inside its turbo block; rlsp keeps it in fsdp_config.
    **{f"{block}turbo_config.distributed.expert_parallel_size": f"{block}expert_parallel_size" for block in _ROLES},
}
# Newer verl serves a reward model through its reward loop only (vLLM engines; reward.reward_model.rollout.*).
REWARD_LOOP_KEY = "reward_model.use_reward_loop"


def rlsp_key(key: str) -> str:
    """The rlsp key that verl's `key` sets (`key` itself when rlsp spells it the same)."""
    for prefix, target in PREFIX_RENAMES.items():
        if key.startswith(prefix):
            key = target + key[len(prefix):]
            break
    return RENAMES.get(key, key)


def _split(text: str) -> tuple[str, str, str, str]:
    """(Hydra's +/++/~ prefix, key, "=" or "", value) of an override."""
    sign = text[: len(text) - len(text.lstrip("+~"))]
    key, eq, value = text[len(sign):].partition("=")
    return sign, key, eq, value


def rename_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(the overrides with verl's other spellings rewritten onto rlsp's keys, one message per setting given
    twice with different values). An exact repeat of a setting under both spellings is kept once."""
    out: list[str] = []
    seen: dict[str, tuple[str, str, bool]] = {}  # rlsp key -> (the override as written, value, renamed)
    problems: list[str] = []
    reward_model_moved = False
    for text in overrides:
        sign, key, eq, value = _split(text)
        target = rlsp_key(key) if eq or sign == "~" else key
        renamed = target != key
        reward_model_moved |= renamed and key.startswith("reward.reward_model.")
        if target in seen and (renamed or seen[target][2]):  # one setting under both spellings
            first, first_value, _ = seen[target]
            if first_value != value:
                problems.append(f"{first} and {text} set {target} twice (verl's two spellings of one setting) with "
                                "different values; set it once")
            continue
        seen[target] = (text, value, renamed)
        out.append(f"{sign}{target}{eq}{value}" if renamed else text)
    if reward_model_moved and not any(_split(t)[1] == REWARD_LOOP_KEY for t in out):
        out.append(f"{REWARD_LOOP_KEY}=true")
    return out, problems
