"""Next-token sampling from logits, as vLLM's sampler does it: temperature, then top-k, then top-p.

`processed_logprobs` returns the log-distribution a token is drawn from (tokens outside top-k/top-p
at -inf, the rest renormalised), which is also the logprob a rollout reports for the sampled token
(the convention of rlsp.rollout.base). Greedy decoding (temperature 0) takes the argmax and reports
the logprob under the unscaled logits.

Legend: N rows, V vocabulary.
"""

from __future__ import annotations

import torch

from rlsp.rollout.base import SamplingConfig


def processed_logprobs(logits_NV: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """log of the distribution `sampling` draws from, [N, V] (fp32 or wider; -inf where top-k/top-p exclude)."""
    x = logits_NV.to(torch.promote_types(logits_NV.dtype, torch.float32))
    if sampling.is_greedy:
        return torch.log_softmax(x, dim=-1)
    x = x / sampling.temperature
    if 0 < sampling.top_k < x.shape[-1]:
        kth_N1 = torch.topk(x, sampling.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth_N1, float("-inf"))
    if sampling.top_p < 1.0:
        # The smallest set of most likely tokens whose mass reaches top_p: a token stays while the mass
        # of the tokens before it (in descending order) is below top_p; the most likely always stays.
        sorted_NV, order_NV = torch.sort(x, dim=-1, descending=True)
        probs_NV = torch.softmax(sorted_NV, dim=-1)
        before_NV = torch.cumsum(probs_NV, dim=-1) - probs_NV
        drop_NV = before_NV >= sampling.top_p
        drop_NV[:, 0] = False
        x = x.masked_fill(torch.zeros_like(drop_NV).scatter(-1, order_NV, drop_NV), float("-inf"))
    return torch.log_softmax(x, dim=-1)


def sample_next(logits_NV: torch.Tensor, sampling: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(the next token of every row [N], its logprob under the processed distribution [N])."""
    logprobs_NV = processed_logprobs(logits_NV, sampling)
    if sampling.is_greedy:
        tokens_N = torch.argmax(logits_NV, dim=-1)
    else:
        # Inverse CDF: the first token whose cumulative probability exceeds u ~ U[0, total) (the total, not 1:
        # the sum's rounding cannot leave u past the end; a token of probability 0 is never the first to
        # exceed u, and the clamp to the last token of probability > 0 covers u rounded up to the total).
        # A tenth of torch.multinomial's time on a [64, 128] batch on CPU.
        cum_NV = torch.cumsum(logprobs_NV.exp(), dim=-1)
        total_N1 = cum_NV[:, -1:]
        u_N1 = torch.rand(total_N1.shape, dtype=cum_NV.dtype, device=cum_NV.device) * total_N1
        last_N = (cum_NV < total_N1).sum(dim=-1)  # the last token of probability > 0
        tokens_N = torch.minimum(torch.searchsorted(cum_NV, u_N1, right=True)[:, 0], last_N)
    return tokens_N, logprobs_NV.gather(-1, tokens_N[:, None])[:, 0]
