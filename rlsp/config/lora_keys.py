"""What the LoRA keys (`actor_rollout_ref.model.lora_*`, verl's names) mean, shared by the code that reads
them: the adapters (rlsp.models.lora), the actor role, the resume checks and the start-up checks of the
keys (rlsp.config.validate_lora). No torch here.
"""

from __future__ import annotations

from typing import Any

LORA_ALL_LINEAR = "all-linear"  # target_modules: every linear layer of the decoder
# Layers an adapter may not wrap: the vocab-chunked logprob head reads lm_head.weight directly (an
# adapter there would be bypassed) and embeddings are not linear layers.
LORA_REFUSED_TARGETS = ("lm_head", "embed_tokens")


def lora_enabled(model: Any) -> bool:
    """LoRA is on with a rank > 0 or an adapter to continue from (verl's rule)."""
    return bool(model.lora_rank) or bool(model.lora_adapter_path)
