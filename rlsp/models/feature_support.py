"""Which memory features a model family takes, decided from its config.json before any worker starts.

`rlsp.check` (and `rlsp.main`'s preflight) call `feature_errors` with the model's config and the run's
`*.model` section; the engine's own checks (rlsp/models/tiled_mlp.py, rms_norm.py, lora.py) would refuse the
same models later, after the workers have loaded them. What is refused and why:

- tiled MLP on a model with MoE layers (gpt_oss, deepseek_v3/v2, qwen3_next, qwen3_5_moe_text, qwen2_moe, ...):
  `TiledMLP` recomputes a gated MLP down(act(gate(x)) * up(x)); a sparse MoE block (router, experts, shared
  experts, gpt-oss's clamped SwiGLU with router bias) is another function, so its layers stay untiled only by
  refusing the key.
- lean RMSNorm on a family whose norms scale by (1 + weight) (gemma, gemma2, gemma3(_text), qwen3_next,
  qwen3_5(_moe)(_text)): the lean norm computes weight * normalized(x).
- LoRA on the MoE families whose experts transformers 5 fuses (deepseek_v3/v2, qwen3_next, qwen3_moe, mixtral,
  olmoe, glm4_moe, qwen2_moe, qwen3_5_moe_text; rlsp.models.lora_targets): `all-linear` adapts the nn.Linear layers
  (attention, dense MLPs, shared experts), a list naming the expert projections also adapts the fused experts
  (rlsp.models.lora_experts), the routers never; a `target_modules` entry that reaches only a router, half of a fused
  pair, or another family's names is refused by name, and so is a saved adapter with tensors on them.

A vision-language model's memory features and LoRA act on its language model only (rlsp.models.vision_lora): the
rules above apply to its text config, and its LoRA targets are checked against the tower by
rlsp.checks.preflight_model.check_wrapper_tower.
"""

from __future__ import annotations

from typing import Any

from rlsp.config.layout import CRITIC_ESTIMATORS
from rlsp.config.lora_keys import lora_enabled
from rlsp.models.critic_vision import critic_vision_errors

MOE_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")
LORA_FUSED_EXPERT_FAMILIES = ("deepseek_v3", "deepseek_v2", "qwen3_next", "qwen3_moe", "mixtral", "olmoe",
                              "glm4_moe", "qwen2_moe", "qwen3_5_moe_text")
ONE_PLUS_WEIGHT_NORMS = ("gemma", "gemma2", "gemma3", "gemma3_text", "qwen3_next", "qwen3_5", "qwen3_5_text",
                         "qwen3_5_moe", "qwen3_5_moe_text", "vaultgemma", "recurrent_gemma")


def moe_setting(config: Any) -> str | None:
    """`key=value` of the config's expert count when the model has MoE layers, else None."""
    aliases = getattr(config, "attribute_map", {})  # name config.json's own key, not transformers' alias of it
    for key in (k for k in MOE_KEYS if k not in aliases):
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return f"{key}={value}"
    return None


def tiled_mlp_problem(config: Any) -> str | None:
    moe = moe_setting(config)
    if moe is None:
        return None
    return (f"tiled_mlp.enabled=true: {config.model_type} has MoE layers ({moe}); tiled MLP recomputes gated MLPs "
            "down(act(gate(x)) * up(x)) only, not a router with experts; legal: tiled_mlp.enabled=false for "
            "this model (Ulysses, gradient checkpointing and token-budget micro-batches still cut activations)")


def lean_rmsnorm_problem(config: Any) -> str | None:
    if config.model_type not in ONE_PLUS_WEIGHT_NORMS:
        return None
    return (f"lean_rmsnorm=true: {config.model_type}'s RMSNorm scales by (1 + weight); the lean RMSNorm computes "
            "weight * x * rsqrt(mean(x^2) + eps) only; legal: lean_rmsnorm=false for this model")


def lora_problem(config: Any, model: Any = None) -> str | None:
    """LoRA on the fused-expert MoE families adapts nn.Linear layers and, when the target list names the expert
    projections, the fused experts (rlsp.models.lora_targets); refused: a target_modules entry of `model` (the run's
    *.model section) that names only a router, half of a fused gate/up pair, or a saved adapter (lora_adapter_path)
    with tensors on a router or per-expert (transformers 4) tensors."""
    if model is None or moe_setting(config) is None or config.model_type not in LORA_FUSED_EXPERT_FAMILIES:
        return None
    from rlsp.models.lora_targets import target_problem  # noqa: PLC0415 -- builds a meta model: torch, transformers

    return target_problem(config, model)


def feature_errors(config: Any, model: Any, prefix: str) -> list[str]:
    """Errors for the features `model` (an `actor_rollout_ref.model` or `critic.model` section) turns on that
    the model of `config` does not take; each names the key under `prefix`."""
    checks = ((model.tiled_mlp.enabled, tiled_mlp_problem), (model.lean_rmsnorm, lean_rmsnorm_problem),
              (hasattr(model, "lora_rank") and lora_enabled(model), lambda c: lora_problem(c, model)))
    problems = [check(config) for enabled, check in checks if enabled]
    return [f"{prefix}{problem}" for problem in problems if problem]


def run_feature_errors(cfg: Any, config: Any) -> list[str]:
    """`feature_errors` of the run `cfg` for the actor's model `config`: the actor and reference, and the critic
    when it starts from the same model (a critic with its own critic.model.path is another config)."""
    errors = feature_errors(config, cfg.actor_rollout_ref.model, "actor_rollout_ref.model.")
    if cfg.algorithm.adv_estimator in CRITIC_ESTIMATORS:  # a vision-language critic: its tower (critic_vision)
        errors += critic_vision_errors(cfg)
    if cfg.algorithm.adv_estimator in CRITIC_ESTIMATORS and not cfg.critic.model.path:
        errors += feature_errors(config, cfg.critic.model, "critic.model.")
    return errors
