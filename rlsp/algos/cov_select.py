"""Token selection of the covariance policy losses (clip_cov, kl_cov) over one micro-batch.

"The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models" (arXiv:2505.22617)
ties entropy collapse to the covariance between a token's log-probability and its advantage. Both
losses score each response token of the micro-batch by

    cov_t = (A_t - mean A) * (logp_t - mean logp)       (means over the micro-batch's response tokens)

and treat a few high-covariance tokens differently. As in verl the statistics are taken per
micro-batch, so the micro-batch size (ppo_micro_batch_size_per_gpu, or the token budget) changes
which tokens are picked and how many.

The picks here work on the micro-batch's response tokens in one canonical order (row-major over its
[B, R] rows, verl's order: the loss context's ``to_batch``), whatever the sequence-parallel sharding:
the loss gathers the scores to every rank, every rank picks the same tokens, and each keeps its own.
clip_cov's random choice is drawn from a generator seeded by :func:`selection_seed`, a digest of the
micro-batch's advantages and mask: data every rank of an sp group holds bit for bit, so all shards
(and one rank holding the whole micro-batch) draw the same tokens.

Shape legend: N response tokens of the micro-batch in canonical order (rlsp.algos.loss_context).
"""

from __future__ import annotations

import hashlib

import torch


def covariance_N(advantages_N: torch.Tensor, logprobs_N: torch.Tensor, on_N: torch.Tensor) -> torch.Tensor:
    """(A - mean A) * (logp - mean logp) over the micro-batch's tokens, means over those with ``on_N``
    (verl's masked means); 0 where ``on_N`` is off."""
    on = on_N.bool()
    count = on.sum().clamp_min(1)
    mean_adv = torch.where(on, advantages_N, 0.0).sum() / count
    mean_logp = torch.where(on, logprobs_N, 0.0).sum() / count
    return torch.where(on, (advantages_N - mean_adv) * (logprobs_N - mean_logp), 0.0)


def selection_seed(advantages_N: torch.Tensor, mask_N: torch.Tensor) -> int:
    """A 63-bit seed from the bytes of the micro-batch's advantages and mask (both data, never a
    forward's output, so identical on every rank and under every layout)."""
    digest = hashlib.sha256()
    for values in (advantages_N, mask_N):
        digest.update(values.detach().to("cpu", torch.float64).contiguous().numpy().tobytes())
    return int.from_bytes(digest.digest()[:8], "little") & (2**63 - 1)


def pick_count(num_tokens: int, fraction: float) -> int:
    """verl's count of picked tokens: max(int(fraction * tokens), 1)."""
    return max(int(fraction * num_tokens), 1)


def pick_clip_cov(cov_N: torch.Tensor, candidate_N: torch.Tensor, count: int, seed: int) -> torch.Tensor:
    """clip_cov: ``count`` tokens drawn uniformly without replacement among the candidates (all of
    them if fewer), as a bool [N]. The draw is a permutation of the candidates in canonical order
    from a CPU generator seeded with ``seed``, so it is the same on every rank."""
    idx = torch.nonzero(candidate_N.detach().cpu(), as_tuple=True)[0]
    generator = torch.Generator().manual_seed(seed)
    chosen = idx[torch.randperm(len(idx), generator=generator)[:count]]
    picked = torch.zeros(cov_N.shape, dtype=torch.bool)
    picked[chosen] = True
    return picked.to(cov_N.device)


def pick_top_cov(cov_N: torch.Tensor, valid_N: torch.Tensor, count: int) -> torch.Tensor:
    """kl_cov: the ``count`` valid tokens of largest covariance (all valid ones if fewer), as a bool
    [N]. Ties go to the earlier token in canonical order (a stable sort), so every rank agrees."""
    cov = torch.where(valid_N.bool(), cov_N.detach(), torch.full_like(cov_N, -torch.inf))
    order = torch.sort(cov.cpu(), descending=True, stable=True).indices
    count = min(count, int(valid_N.bool().sum()))
    picked = torch.zeros(cov_N.shape, dtype=torch.bool)
    picked[order[:count]] = True
    return picked.to(cov_N.device)
