"""benchmarks/linear_attention_memory.py: its widths reach the model it builds (`--head-dim` narrows every head dim,
the defaults are Qwen3-Next's Gated DeltaNet widths), bad widths are refused by name, and one tiny run at Ulysses
2 reports each rank's share of the tokens and the per-local-token figure from its own numbers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from bench_scripts import BENCHMARKS, load_benchmark

TINY = ["--hidden", "32", "--key-heads", "2", "--value-heads", "4", "--head-dim", "8"]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("linear_attention_memory")


def test_defaults_are_qwen3_next_widths(bench):
    config = bench._config(bench.parse_args([]))
    assert (config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads) == (2048, 16, 32)
    assert (config.linear_key_head_dim, config.linear_value_head_dim, config.head_dim) == (128, 128, 128)
    assert config.layer_types == ["linear_attention"]


def test_head_dim_narrows_every_head_dim(bench):
    args = bench.parse_args([*TINY, "--layers", "linear_attention", "full_attention"])
    config = bench._config(args)
    assert (config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads) == (32, 2, 4)
    assert (config.linear_key_head_dim, config.linear_value_head_dim, config.head_dim) == (8, 8, 8)
    assert config.layer_types == ["linear_attention", "full_attention"] and config.num_hidden_layers == 2


@pytest.mark.parametrize("argv,named", [
    (["--key-heads", "4", "--value-heads", "6"], "--value-heads 6 must be a multiple of --key-heads 4"),
    (["--head-dim", "0"], "0 is not a positive integer"),
    (["--layers", "mamba"], "invalid choice: 'mamba'"),
])
def test_bad_widths_are_refused_by_name(bench, capsys, argv, named):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert named in capsys.readouterr().err


def test_tiny_run_reports_each_ranks_share(bench):
    tokens = 256
    out = subprocess.run([sys.executable, str(BENCHMARKS / "linear_attention_memory.py"), "--tokens", str(tokens),
                          "--ulysses", "2", "--threads", "1", *TINY], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["head_dims"] == [8, 8] and line["linear_heads"] == [2, 4] and line["hidden"] == 32
    for run, u in zip(line["runs"], (2,), strict=True):
        assert run["ulysses"] == u and [r["local_tokens"] for r in run["per_rank"]] == [tokens // u] * u
        for rank in run["per_rank"]:
            assert rank["rss_peak_mib"] - rank["rss_before_mib"] == pytest.approx(rank["peak_delta_mib"], abs=1)
        assert run["max_peak_delta_mib"] == max(r["peak_delta_mib"] for r in run["per_rank"])
        local = tokens // u
        assert run["delta_kib_per_local_token"] == round(run["max_peak_delta_mib"] * 1024 / local, 1)
