"""compute_token_logprobs_sum_pi_squared against the full softmax (fp64, every token, atol 1e-12): chunk
sizes that do and do not divide the token count, more tokens than one 128-row reduction block, a
temperature; its logprobs equal compute_token_logprobs' exactly; bad shapes are refused."""

from __future__ import annotations

import pytest
import torch

from rlsp.models.logprobs import compute_token_logprobs, compute_token_logprobs_sum_pi_squared

T, H, V = 300, 8, 37


@pytest.mark.parametrize("chunk", [1, 7, 128, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_matches_the_full_softmax(chunk: int, temperature: float) -> None:
    g = torch.Generator().manual_seed(chunk)
    hidden, weight = torch.randn(T, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (T,), generator=g)
    lp, spp = compute_token_logprobs_sum_pi_squared(hidden, weight, labels, temperature=temperature, chunk_size=chunk)
    p = torch.softmax(hidden @ weight.t() / temperature, -1)
    torch.testing.assert_close(spp, (p * p).sum(-1), rtol=0.0, atol=1e-12)
    torch.testing.assert_close(lp, p.log().gather(-1, labels[:, None])[:, 0], rtol=0.0, atol=1e-12)
    plain, _ = compute_token_logprobs(hidden, weight, labels, temperature=temperature, chunk_size=chunk)
    assert torch.equal(lp, plain)
    assert float(spp.min()) >= 1.0 / V - 1e-12 and float(spp.max()) <= 1.0  # 1/V <= sum p^2 <= 1


def test_refuses_bad_inputs() -> None:
    with pytest.raises(ValueError, match=r"labels \(3,\) must be \[T=2\]"):
        compute_token_logprobs_sum_pi_squared(torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature=0; it must be > 0"):
        compute_token_logprobs_sum_pi_squared(torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long),
                                              temperature=0)
