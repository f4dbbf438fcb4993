"""benchmarks/sequence_comm.py's tensor-parallel closed form and the counter it checks the backward re-gathers with
(benchmarks/collective_counters.py): the bytes below are what the script measured on gloo (docs/benchmarks.md,
"Sequence-parallel communication"; the script asserts measured == formula on every rank), so a formula that drifts
from what rlsp.parallel.tp_sp sends fails here without launching ranks."""

from __future__ import annotations

import pytest
import torch
from bench_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("sequence_comm")


@pytest.mark.parametrize("tp,seq_par,tokens,expected", [
    # TP 2 with sequence-parallel activations on the 488-token stream: backward re-gathers both blocks' inputs
    (2, True, 488, {"all_gather": 249_856, "reduce_scatter": 499_712, "all_reduce": 0, "regather": 249_856,
                    "off_rank": 499_712, "gloo_off_rank": 749_568, "off_rank_bwd": 749_568,
                    "gloo_off_rank_bwd": 999_424}),
    # without sequence parallel: all-reduces both ways, nothing saved as a shard, nothing re-gathered
    (2, False, 488, {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 499_712, "regather": 0,
                     "off_rank": 499_712, "gloo_off_rank": 499_712, "off_rank_bwd": 499_712,
                     "gloo_off_rank_bwd": 499_712}),
    # Ulysses 2 x TP 2: the tp group holds 244 tokens
    (2, True, 244, {"all_gather": 124_928, "reduce_scatter": 249_856, "all_reduce": 0, "regather": 124_928,
                    "off_rank": 249_856, "gloo_off_rank": 374_784, "off_rank_bwd": 374_784,
                    "gloo_off_rank_bwd": 499_712}),
])
def test_tp_formula_equals_the_measured_bytes(bench, tp, seq_par, tokens, expected):
    assert bench.compute_tp_formula(tp, seq_par, tokens, 4) == expected


def test_tp_formula_refuses_a_stream_tp_does_not_divide(bench):
    with pytest.raises(ValueError, match="S=487 tokens are not a multiple of tp=2"):
        bench.compute_tp_formula(2, True, 487, 4)


def test_regather_counter_counts_the_input_not_the_output():
    counters = load_benchmark("collective_counters")
    counter, phase, seen = {"bwd": {}}, ["bwd"], []
    counted = counters._counting(counter, phase, counters.REGATHER, lambda out, local, group=None: seen.append(group),
                                 arg=1)
    counted(torch.empty(2, 8, 4), torch.empty(1, 8, 4), group="g")
    assert seen == ["g"]
    assert counter["bwd"] == {"tp_sp_regather_calls": 1, "tp_sp_regather_bytes": 8 * 4 * 4}
