"""TokenLogprobModel: a HF causal LM run on this rank's shard of a packed stream, returning token logprobs.

Every head model of rlsp (this one for the policy, `rlsp.models.value.ValueModel` for the critic)
shares one calling convention, so the engine can run any of them through the same packed,
sequence-parallel path: `forward(input_ids_S, position_ids_S, labels_S, sp_context, **head_kwargs)`
returns a dict of per-token fp32 tensors [S], and `decoder` is the HF base model whose `layers`
are the units FSDP2 shards.

The module takes the LOCAL shards (S = T / sp tokens: input ids, positions and labels already
rolled on the full stream, then sliced with `rlsp.parallel.ulysses.shard_for_rank`) and the SP
context of the micro-batch. Under tensor parallelism (`rlsp.parallel.tensor_parallel`, which sets
`tp_info`) every rank of a tp group gets the same [S] inputs and an SP context built with the tp
rank's head counts; with sequence parallelism the outputs cover the tp rank's contiguous [S/tp]
block of the shard (`tp_info.local_tokens`), without it all S tokens. Everything, parameter access
included, happens inside `forward`, so the module can be wrapped by FSDP2 `fully_shard` at the root.
The output layer is read as `lm.lm_head.weight`, which is also correct for tied embeddings.

Legend: S local tokens, H hidden size, V vocabulary size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlsp.models.attention import ULYSSES_ATTN_IMPL
from rlsp.models.logprobs import compute_token_logprobs, compute_token_logprobs_sum_pi_squared
from rlsp.models.vision_inputs import TOWER_FAMILIES
from rlsp.parallel.tensor_parallel import TPInfo, tp_local_param, tp_local_tokens
from rlsp.parallel.ulysses import SPContext


def check_local_inputs(sp_context: SPContext, **inputs_S: torch.Tensor) -> None:
    """Every input must be this rank's 1-D shard of the packed stream."""
    for name, x in inputs_S.items():
        if x.dim() != 1 or x.shape[0] != sp_context.local_len:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}; expected the local shard [S={sp_context.local_len}] "
                f"(slice the packed stream with shard_for_rank)"
            )


def compute_hidden_states(
    decoder: nn.Module,
    input_ids_S: torch.Tensor,
    position_ids_S: torch.Tensor,
    sp_context: SPContext,
    tp: TPInfo | None = None,
    inputs: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Final hidden states [S, H] of a HF base model ([S/tp, H] under tensor + sequence parallelism);
    checks every layer went through Ulysses attention. `inputs` replace the ids and 1-D positions as the
    decoder's inputs (a vision-language model's inputs_embeds [1, S, H] and position_ids [3, 1, S])."""
    local_len = sp_context.local_len if tp is None else tp.local_len(sp_context.local_len)
    num_layers = int(decoder.config.num_hidden_layers)
    sp_context.stats.attn_calls = 0
    if inputs is None:
        inputs = {"input_ids": input_ids_S.unsqueeze(0), "position_ids": position_ids_S.unsqueeze(0)}
    out = decoder(**inputs, sp_context=sp_context, use_cache=False)
    calls = sp_context.stats.attn_calls
    if calls != num_layers:
        raise RuntimeError(
            f"attention did not go through {ULYSSES_ATTN_IMPL} in {num_layers - calls} of {num_layers} layers "
            f"({calls} calls): unsupported architecture {type(decoder).__name__} (model attn_implementation="
            f"{getattr(decoder.config, '_attn_implementation', None)!r}); see rlsp.models.family_checks.check_sp_support"
        )
    hidden_SH = tp_local_tokens(out.last_hidden_state)[0]
    if hidden_SH.shape[0] != local_len:
        raise RuntimeError(f"decoder returned {hidden_SH.shape[0]} tokens, expected {local_len} (tp={tp})")
    return hidden_SH


class TokenLogprobModel(nn.Module):
    """Wraps a HF causal LM (`self.lm`); forward returns per-token logprobs (and entropy) of local tokens."""

    def __init__(self, lm: nn.Module, chunk_size: int = 1024, compiled: bool = False) -> None:
        super().__init__()
        model_type = getattr(getattr(lm, "config", None), "model_type", None)
        if model_type in TOWER_FAMILIES and type(self) is TokenLogprobModel:
            raise ValueError(f"{model_type} is a vision-language model: build its head with "
                             "rlsp.models.vision_lm.build_logprob_model (VisionLogprobModel), not TokenLogprobModel")
        self.lm = lm
        self.chunk_size = chunk_size  # tokens per vocab-projection chunk (memory O(chunk_size * V))
        self.compiled = compiled  # the entropy head through torch.compile (use_torch_compile; rlsp.models.logprobs)
        self.tp_info: TPInfo | None = None  # set by rlsp.parallel.tensor_parallel.apply_tensor_parallel

    @property
    def decoder(self) -> nn.Module:
        return self.lm.model

    def forward(
        self,
        input_ids_S: torch.Tensor,
        position_ids_S: torch.Tensor,
        labels_S: torch.Tensor,
        sp_context: SPContext,
        temperature: float = 1.0,
        with_entropy: bool = False,
        with_sum_pi_squared: bool = False,
        multi_modal: Any = None,
    ) -> dict[str, torch.Tensor]:
        """Local shards [S] in -> {"logprobs": [S] fp32, "entropy": [S] fp32 (only with_entropy),
        "sum_pi_squared": [S] fp32 (only with_sum_pi_squared: sum_v p_v^2, no gradient)};
        [S/tp] (this tp rank's block of the shard) under tensor + sequence parallelism.

        logprobs[i] = log p(labels_S[i] | tokens up to local token i of its sequence); entries where
        the packed batch's label_mask is False are meaningless and must be masked by the caller.
        """
        check_local_inputs(sp_context, input_ids=input_ids_S, position_ids=position_ids_S, labels=labels_S)
        if multi_modal is not None:
            raise ValueError(f"the rows carry images but {type(self.lm).__name__} is a text model; images train on the "
                             "vision-language families of rlsp.models.vision_inputs.VISION_FAMILIES (VisionLogprobModel)")
        hidden_SH = compute_hidden_states(self.decoder, input_ids_S, position_ids_S, sp_context, self.tp_info)
        return self.head_outputs(hidden_SH, labels_S, temperature, with_entropy, with_sum_pi_squared)

    def head_outputs(self, hidden_SH: torch.Tensor, labels_S: torch.Tensor, temperature: float = 1.0,
                     with_entropy: bool = False, with_sum_pi_squared: bool = False) -> dict[str, torch.Tensor]:
        """The output layer on final hidden states [S, H] ([S/tp, H]): forward's dict of per-token tensors."""
        tp = self.tp_info
        lm_head = self.lm.lm_head
        if getattr(lm_head, "bias", None) is not None:
            raise RuntimeError("lm_head has a bias; the vocab-chunked logprobs support a bias-free output layer only")
        softcap = getattr(self.lm.config, "final_logit_softcapping", None) or None
        head = (hidden_SH, tp_local_param(lm_head.weight, tp), labels_S if tp is None else tp.local_tokens(labels_S))
        if with_sum_pi_squared:  # the old-logprob pass of the optimal token baseline: no gradient, no entropy
            if with_entropy or torch.is_grad_enabled():
                raise RuntimeError("sum_pi_squared is computed without gradient and without the entropy")
            logprobs_S, sum_sq_S = compute_token_logprobs_sum_pi_squared(*head, temperature=temperature,
                                                                         chunk_size=self.chunk_size, softcap=softcap)
            return {"logprobs": logprobs_S, "sum_pi_squared": sum_sq_S}
        logprobs_S, entropy_S = compute_token_logprobs(
            *head, temperature=temperature, chunk_size=self.chunk_size, with_entropy=with_entropy,
            compiled=self.compiled, softcap=softcap,
        )
        return {"logprobs": logprobs_S} if entropy_S is None else {"logprobs": logprobs_S, "entropy": entropy_S}
