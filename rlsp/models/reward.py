"""RewardModel: a frozen sequence-classification model (HF `*ForSequenceClassification`, one label)
run on a packed stream, returning its score at every token.

It follows the calling convention of `rlsp.models.lm` (local shards of a packed stream in, a dict of
per-token fp32 tensors out), so the engine runs it through the same packed, Ulysses-sharded path as
the policy and the critic. `scores[t]` is the classification head applied to the hidden state of
token t — what the HF model's `score` layer computes before it pools at the last token; the
sequence's reward is `scores` at its last real token, which `FSDPEngine.infer(..., last_token=True)`
picks out of the gathered stream (the HF model pools at the last non-padding token in the same way).

Legend: S local tokens, H hidden size.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForSequenceClassification, PreTrainedModel

from rlsp.models.attention import ULYSSES_ATTN_IMPL, register_ulysses_attention
from rlsp.models.family_checks import check_sp_support
from rlsp.models.linear_attention import apply_linear_attention
from rlsp.models.lm import check_local_inputs, compute_hidden_states
from rlsp.parallel.tensor_parallel import TPInfo
from rlsp.parallel.ulysses import SPContext

SCORE_HEAD = "score"  # the classification layer's name in HF's *ForSequenceClassification (Llama, Qwen2, ...)


def check_reward_config(config) -> None:
    """Raise ValueError unless `config` describes a one-label sequence-classification model rlsp can run."""
    arch = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in arch):
        raise ValueError(f"architectures={arch}: a reward model must be a *ForSequenceClassification checkpoint "
                         "(AutoModelForSequenceClassification with num_labels=1); a causal LM has no trained score head")
    if int(getattr(config, "num_labels", 1)) != 1:
        raise ValueError(f"num_labels={config.num_labels}: a reward model has one label (one score per sequence)")
    check_sp_support(config, 1)


def load_reward_model(path: str, *, dtype: torch.dtype = torch.float32,
                      attn_implementation: str = ULYSSES_ATTN_IMPL) -> PreTrainedModel:
    """The HF sequence-classification model at `path` (checked with `check_reward_config`)."""
    config = AutoConfig.from_pretrained(path)
    check_reward_config(config)
    if attn_implementation == ULYSSES_ATTN_IMPL:
        register_ulysses_attention()
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    if attn_implementation == ULYSSES_ATTN_IMPL:
        apply_linear_attention(model)  # Gated DeltaNet layers (Qwen3-Next / Qwen3.5): packed, Ulysses-aware form
    return model


class RewardModel(nn.Module):
    """Wraps a HF `*ForSequenceClassification` (`self.hf`): its base model and its `score` layer."""

    def __init__(self, hf: PreTrainedModel) -> None:
        super().__init__()
        head = getattr(hf, SCORE_HEAD, None)
        if not isinstance(head, nn.Linear) or head.out_features != 1:
            raise ValueError(f"{type(hf).__name__} has no one-output linear `{SCORE_HEAD}` layer ({head!r}); rlsp runs "
                             "sequence-classification models whose head is `score` (Llama, Qwen2, Mistral, Gemma...)")
        self.hf = hf
        self.tp_info: TPInfo | None = None  # reward models run without tensor parallelism

    @property
    def decoder(self) -> nn.Module:
        return getattr(self.hf, self.hf.base_model_prefix)

    @property
    def config(self):
        return self.hf.config

    def forward(self, input_ids_S: torch.Tensor, position_ids_S: torch.Tensor, labels_S: torch.Tensor | None,
                sp_context: SPContext) -> dict[str, torch.Tensor]:
        """Local shards [S] in -> {"scores": [S] fp32}. `labels_S` is unused (kept for the shared signature)."""
        del labels_S
        check_local_inputs(sp_context, input_ids=input_ids_S, position_ids=position_ids_S)
        hidden_SH = compute_hidden_states(self.decoder, input_ids_S, position_ids_S, sp_context)
        head = getattr(self.hf, SCORE_HEAD)
        scores_S = torch.nn.functional.linear(hidden_SH, head.weight, head.bias).squeeze(-1).float()
        # A fresh tensor, not a view of the head's output: FSDP hooks the returned tensors.
        return {"scores": scores_S.clone() if scores_S._base is not None else scores_S}
