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
- LoRA on the MoE families whose MLP targets peft rewrites (its transformers v4 -> v5 config conversion) onto
  the fused expert and router parameters (`ParamWrapper` adapters on `*Experts` / `*TopkRouter`), which rlsp's
  LoRA (nn.Linear adapters, merged for rollout) does not support: deepseek_v3, deepseek_v2, qwen3_next,
  qwen3_moe, mixtral, olmoe, glm4_moe (each measured: `LoraAdapters` refuses them after loading). gpt_oss,
  qwen2_moe and qwen3_5_moe_text keep nn.Linear targets only (gpt_oss trains exactly with LoRA at Ulysses 2).
"""

from __future__ import annotations

from typing import Any

from rlsp.config.layout import CRITIC_ESTIMATORS
from rlsp.models.vision_inputs import VISION_TEXT_TYPES

MOE_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")
LORA_FUSED_EXPERT_FAMILIES = ("deepseek_v3", "deepseek_v2", "qwen3_next", "qwen3_moe", "mixtral", "olmoe",
                              "glm4_moe")
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


def lora_problem(config: Any) -> str | None:
    moe = moe_setting(config)
    if moe is None or config.model_type not in LORA_FUSED_EXPERT_FAMILIES:
        return None
    return (f"lora_rank > 0: {config.model_type} has MoE layers ({moe}) whose MLP targets peft moves onto the "
            "fused expert and router parameters (peft's transformers v5 conversion), which rlsp's LoRA does "
            "not support (nn.Linear adapters only); legal: lora_rank=0 for this model (gpt_oss's MoE takes LoRA "
            "on its attention layers)")


def vision_problem(config: Any, key: str) -> str | None:
    """`key` on a vision-language model (its text config's model type): not verified with the vision tower."""
    if getattr(config, "model_type", None) not in VISION_TEXT_TYPES:
        return None
    return (f"{key}: {config.model_type.removesuffix('_text')} is a vision-language model, which rlsp has not verified "
            f"with this feature (it would also reach the vision tower's layers); legal: leave it off for this model")


def feature_errors(config: Any, model: Any, prefix: str) -> list[str]:
    """Errors for the features `model` (an `actor_rollout_ref.model` or `critic.model` section) turns on that
    the model of `config` does not take; each names the key under `prefix`."""
    checks = ((model.tiled_mlp.enabled, tiled_mlp_problem), (model.lean_rmsnorm, lean_rmsnorm_problem),
              (bool(getattr(model, "lora_rank", 0)), lora_problem))
    problems = [check(config) for enabled, check in checks if enabled]
    keys = (("tiled_mlp.enabled=true", model.tiled_mlp.enabled), ("lean_rmsnorm=true", model.lean_rmsnorm),
            ("lora_rank > 0", bool(getattr(model, "lora_rank", 0))))
    problems += [vision_problem(config, key) for key, enabled in keys if enabled]
    return [f"{prefix}{problem}" for problem in problems if problem]


def run_feature_errors(cfg: Any, config: Any) -> list[str]:
    """`feature_errors` of the run `cfg` for the actor's model `config`: the actor and reference, and the critic
    when it starts from the same model (a critic with its own critic.model.path is another config)."""
    errors = feature_errors(config, cfg.actor_rollout_ref.model, "actor_rollout_ref.model.")
    if cfg.algorithm.adv_estimator in CRITIC_ESTIMATORS and not cfg.critic.model.path and \
            getattr(config, "model_type", None) in VISION_TEXT_TYPES:
        errors.append(f"critic.model.path: unset, so the critic would start from the actor's {config.model_type} "
                      "(vision-language) model, which rlsp trains as the policy only; legal: a text model's path")
    if cfg.algorithm.adv_estimator in CRITIC_ESTIMATORS and not cfg.critic.model.path:
        errors += feature_errors(config, cfg.critic.model, "critic.model.")
    return errors
