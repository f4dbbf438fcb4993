"""Checkpoint names for the weights a trainer sends: transformers' own reverse conversion, one tensor at a time.

transformers (5.x) holds a mixture-of-experts layer's experts as FUSED tensors in memory
(`model.layers.1.mlp.experts.gate_up_proj` [E, 2I, H], `...experts.down_proj` [E, H, I]), while checkpoints on disk,
which vLLM's loaders read at start and in `reload_weights`, name them per expert (`...experts.0.gate_proj.weight`
[I, H], ...; mixtral: `block_sparse_moe.experts.0.w1.weight`). A trainer sends `named_parameters()` names; vLLM
0.32's Mixtral loader refuses them ("There is no module or parameter named 'layers.0.mlp'") and DeepSeek's raises a
KeyError ('layers.1.mlp.experts.gate_up_proj'); its Qwen3-MoE loader happens to take both. `save_pretrained` writes
the per-expert names through
`transformers.core_model_loading.revert_weight_conversion` (the family's conversion mapping of
transformers/conversion_mapping.py, reversed: split the stacked experts, chunk gate|up); `CheckpointNames` applies
that same function to each tensor as it streams past (save_pretrained does it per shard when offloaded), so no more
than one fused parameter and its per-expert pieces are held at a time, never the whole model twice.

The conversion needs the model's module tree (sub-model scopes, class names) but no weights: a model built on the
meta device from the HF config stands in for it. Families with no conversion mapping (llama, qwen2, gemma, gpt_oss
whose checkpoints keep the fused experts, ...) pass through untouched, without building anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch


def has_checkpoint_conversion(hf_config: Any) -> bool:
    """Whether transformers registers a load-time conversion (fused experts, renames) for this model's type or class."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping  # noqa: PLC0415

    keys = [getattr(hf_config, "model_type", None), *(getattr(hf_config, "architectures", None) or [])]
    return any(key and get_checkpoint_conversion_mapping(key) is not None for key in keys)


class CheckpointNames:
    """Maps trainer-named tensors (in-memory `named_parameters()` names and layouts) to checkpoint-named ones."""

    def __init__(self, hf_config: Any) -> None:
        from transformers import AutoModelForCausalLM  # noqa: PLC0415

        with torch.device("meta"):  # the module tree only: no weight is allocated
            self.meta_model = AutoModelForCausalLM.from_config(hf_config)

    def convert(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The checkpoint tensors that `save_pretrained` would write for parameter `name` (holding `tensor`): the
        tensor itself under its checkpoint name, or one slice per expert for a fused experts tensor."""
        from transformers.core_model_loading import revert_weight_conversion  # noqa: PLC0415

        return revert_weight_conversion(self.meta_model, {name: tensor})

    def __call__(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            yield from self.convert(name, tensor).items()


def build_checkpoint_names(hf_config: Any) -> CheckpointNames | None:
    """A `CheckpointNames` for this model, or None when its in-memory names already are its checkpoint names."""
    return CheckpointNames(hf_config) if has_checkpoint_conversion(hf_config) else None
