"""Rollout correction (rlsp/algos/rollout_is.py, rollout_rs.py, rollout_correction.py) against values
computed by hand.

Two rows, log-ratios old - rollout chosen so every weight is a round number:
    row 0: [ln 2, 0, -ln 2]  -> rho = [2, 1, 0.5]
    row 1: [ln 3, 0, pad]    -> rho = [3, 1]
"""

from __future__ import annotations

import math

import pytest
import torch

from rlsp.algos.registry import list_rollout_is, list_rollout_rs
from rlsp.algos.rollout_correction import RolloutCorrection, compute_offpolicy_metrics, compute_rollout_correction
from rlsp.algos.rollout_is import compute_rollout_is_weights
from rlsp.algos.rollout_rs import compute_rollout_rs_mask, parse_rs_thresholds

F64 = torch.float64
LN2, LN3 = math.log(2.0), math.log(3.0)


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, 0.0]], dtype=F64)
    log_ratio = torch.tensor([[LN2, 0.0, -LN2], [LN3, 0.0, 5.0]], dtype=F64)  # the pad's 5.0 must never leak
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)
    return old, old - log_ratio, mask


def _close(actual, expected) -> None:
    torch.testing.assert_close(torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64),
                               rtol=0, atol=1e-12)


def test_registries_hold_verls_names() -> None:
    assert list_rollout_is() == ["sequence", "token"]
    assert list_rollout_rs() == sorted(["token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                                        "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3"])


def test_token_weights_truncated_and_metrics() -> None:
    old, rollout, mask = _inputs()
    w, m = compute_rollout_is_weights(old, rollout, mask, "token", threshold=2.0)
    _close(w, [[2.0, 1.0, 0.5], [2.0, 1.0, 0.0]])
    assert not w.requires_grad
    _close(m["rollout_is_mean"], 7.5 / 5)  # before truncation
    _close(m["rollout_is_max"], 3.0)
    _close(m["rollout_is_min"], 0.5)
    _close(m["rollout_is_ratio_fraction_high"], 1 / 5)
    _close(m["rollout_is_ratio_fraction_low"], 0.0)  # 0.5 is not below 1/2
    # ESS: weights clamped to [0.5, 2] -> [2, 1, .5, 2, 1], mean 1.3 (+1e-8 guard); 1 / mean((w / 1.3)^2)
    _close(m["rollout_is_eff_sample_size"], 1.0 / ((10.25 / 5) / (1.3 + 1e-8) ** 2))


def test_token_batch_normalize_divides_by_truncated_token_mean() -> None:
    old, rollout, mask = _inputs()
    w, m = compute_rollout_is_weights(old, rollout, mask, "token", threshold=2.0, batch_normalize=True)
    _close(m["rollout_is_batch_norm_factor"], 6.5 / 5)
    _close(w, torch.tensor([[2.0, 1.0, 0.5], [2.0, 1.0, 0.0]], dtype=F64) / 1.3)


def test_sequence_weights_are_the_truncated_product_on_every_token() -> None:
    old, rollout, mask = _inputs()
    w, m = compute_rollout_is_weights(old, rollout, mask, "sequence", threshold=2.0)
    _close(w, [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]])  # row 0: 2 * 1 * 0.5 = 1; row 1: 3 -> 2
    _close(m["rollout_is_mean"], 9.0 / 5)
    _close(m["rollout_is_max"], 3.0)
    _close(m["rollout_is_min"], 1.0)
    _close(m["rollout_is_ratio_fraction_high"], 0.5)  # rows
    w_norm, m_norm = compute_rollout_is_weights(old, rollout, mask, "sequence", threshold=2.0, batch_normalize=True)
    _close(m_norm["rollout_is_batch_norm_factor"], 1.5)  # mean over rows of [1, 2]
    _close(w_norm, w / 1.5)


# (rollout_rs, rollout_rs_threshold, expected mask, token fraction rejected, row fraction)
RS_CASES = [
    ("token_k1", 2.5, [[1, 1, 1], [0, 1, 0]], 1 / 5, 1 / 2),  # lower 1/2.5: k1 = -ln 3 < ln 0.4 rejected
    ("token_k1", "0.4_1.9", [[1, 1, 0], [0, 1, 0]], 2 / 5, 1.0),  # k1 = ln 2 > ln 1.9 rejected
    ("token_k2", 0.3, [[1, 1, 1], [0, 1, 0]], 1 / 5, 1 / 2),  # 0.5 ln^2 3 = 0.60 > 0.3; 0.5 ln^2 2 = 0.24
    ("token_k3", 0.5, [[1, 1, 1], [0, 1, 0]], 1 / 5, 1 / 2),  # 3 - 1 - ln 3 = 0.90; 2 - 1 - ln 2 = 0.31
    ("seq_sum_k1", "0.5_2.0", [[1, 1, 1], [0, 0, 0]], 2 / 5, 1 / 2),  # row sums 0 and -ln 3 < ln 0.5
    ("seq_mean_k3", 0.3, [[1, 1, 1], [0, 0, 0]], 2 / 5, 1 / 2),  # row means 0.5/3 and 0.90/2
    ("seq_sum_k2", 0.5, [[1, 1, 1], [0, 0, 0]], 2 / 5, 1 / 2),  # row sums ln^2 2 = 0.48 and 0.60
    ("seq_max_k2", 0.25, [[1, 1, 1], [0, 0, 0]], 2 / 5, 1 / 2),  # row maxima 0.24 and 0.60
    ("token_k2,seq_mean_k3", "1.0,0.2", [[1, 1, 1], [0, 0, 0]], 2 / 5, 1 / 2),
]


@pytest.mark.parametrize("option,threshold,expected,token_frac,row_frac", RS_CASES)
def test_rejection_masks(option, threshold, expected, token_frac, row_frac) -> None:
    old, rollout, mask = _inputs()
    new_mask, m = compute_rollout_rs_mask(old, rollout, mask, option, threshold)
    _close(new_mask, expected)
    _close(m["rollout_rs_masked_fraction"], token_frac)
    _close(m["rollout_rs_seq_masked_fraction"], row_frac)


def test_threshold_parsing_and_refusals() -> None:
    assert parse_rs_thresholds(["token_k1"], 2.0) == [(0.5, 2.0)]
    assert parse_rs_thresholds(["token_k1", "seq_max_k3"], "0.7_1.3,0.1") == [(0.7, 1.3), (None, 0.1)]
    old, rollout, mask = _inputs()
    refusals = {
        ("geometric", 2.0): "use the current option 'seq_mean_k1'",
        ("seq_max_k1", 2.0): "unknown rollout_rs option 'seq_max_k1'; legal names",
        ("token_k2", "0.1_0.2"): "must be one positive upper bound",
        ("token_k1,token_k2", "1,2,3"): "3 entries for 2 rollout_rs options",
        ("token_k2", None): "rollout_rs_threshold must be set",
        ("token_k3", -1.0): "must be one positive upper bound",
    }
    for (option, threshold), message in refusals.items():
        with pytest.raises(ValueError, match=message):
            compute_rollout_rs_mask(old, rollout, mask, option, threshold)


def test_combined_correction_and_offpolicy_metrics() -> None:
    old, rollout, mask = _inputs()
    settings = RolloutCorrection(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k2",
                                 rollout_rs_threshold=0.3)
    w, new_mask, m = compute_rollout_correction(old, rollout, mask, settings)
    _close(w, [[2.0, 1.0, 0.5], [2.0, 1.0, 0.0]])  # weights on every valid token; rejection only masks
    _close(new_mask, [[1, 1, 1], [0, 1, 0]])
    assert all(k.startswith("rollout_corr/") for k in m)
    _close(m["rollout_corr/kl"], -LN3 / 5)  # mean(rollout - old)
    _close(m["rollout_corr/chi2_token"], (4 + 1 + 0.25 + 9 + 1) / 5 - 1)
    _close(m["rollout_corr/chi2_seq"], (1 + 9) / 2 - 1)
    k3 = [2 - 1 - LN2, 0.0, 0.5 - 1 + LN2, 3 - 1 - LN3, 0.0]
    _close(m["rollout_corr/k3_kl"], sum(k3) / 5)
    _close(compute_offpolicy_metrics(old, old, mask)["chi2_token"], 0.0)
    none, same_mask, _ = compute_rollout_correction(old, rollout, mask, RolloutCorrection())
    assert none is None and same_mask is mask
