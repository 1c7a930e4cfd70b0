"""``vllm-afd bench-ttft``'s pure parts: percentiles, figures, ratios, table."""

from __future__ import annotations

import argparse

import pytest

from vllm_afd.cli import bench_ttft as bt
from vllm_afd.cli.main import build_parser


def test_percentile_interpolates_between_closest_ranks():
    assert bt.percentile([3.0], 99) == 3.0
    assert bt.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert bt.percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0
    assert bt.percentile(list(map(float, range(101))), 90) == 90.0


def test_figures_count_failed_requests_as_missing_the_slo():
    row = bt.figures([0.1, 0.2, 0.3, 2.0], failed=1, duration_s=2.0, slo_s=0.5)
    assert row["requests"] == 5 and row["failed"] == 1
    assert row["slo_attainment"] == pytest.approx(3 / 5)
    assert row["requests_per_s"] == 2.0
    assert row["ttft_p50_ms"] == pytest.approx(250.0)
    empty = bt.figures([], failed=2, duration_s=1.0, slo_s=1.0)
    assert empty["ttft_p50_ms"] is None and empty["slo_attainment"] == 0.0


def test_ratios_are_to_plain_vllm_at_the_same_rate_and_the_table_shows_them():
    rows = [
        {"target": bt.PLAIN, "rate": 1.0, **bt.figures([0.1], 0, 1.0, 1.0)},
        {"target": "AFD async 1A2F", "rate": 1.0, **bt.figures([0.2], 0, 1.0, 1.0)},
        {"target": "AFD p2p 1A1F", "rate": 2.0, **bt.figures([0.3], 0, 1.0, 1.0)},
    ]
    out = bt.with_ratios(rows)
    assert out[0]["p50_vs_plain"] == 1.0
    assert out[1]["p50_vs_plain"] == pytest.approx(2.0)
    assert out[2]["p50_vs_plain"] is None  # no plain run at 2 req/s
    table = bt.format_table(out, 1000.0)
    assert "2.00x" in table and "AFD async 1A2F" in table
    assert table.splitlines()[-1] == "SLO: TTFT <= 1000 ms (failed requests miss it)"


def test_bad_rates_are_refused_before_any_server_starts(capsys):
    args = build_parser().parse_args(["bench-ttft", "m", "--rates", "1,x"])
    assert bt.run_bench_ttft(args) == 2
    assert "--rates='1,x' is not a comma-separated list" in capsys.readouterr().err
    args = build_parser().parse_args(["bench-ttft", "m", "--rates", "0"])
    assert bt.run_bench_ttft(args) == 2


def test_the_synchronous_connector_runs_at_most_a_ffn_ranks():
    ns = argparse.Namespace(
        model="m", attention_ranks=1, ffn_ranks=2, port=8000, afd_port=29650,
        vllm_args=["--dtype", "float32"], ready_timeout=60.0,
    )  # fmt: skip
    assert bt._afd_spec(ns, "p2p").ffn_ranks == 1
    spec = bt._afd_spec(ns, "async")
    assert (spec.ffn_ranks, spec.connector, spec.ubatches) == (2, "async", 1)
    assert spec.gate_on_attention
    staged = bt._afd_spec(ns, "async+stages")
    assert (staged.ffn_ranks, staged.connector, staged.ubatches) == (2, "async", 2)
    assert staged.connector_extra_config == {}
    both = bt._afd_spec(ns, "async+shared+stages")
    assert both.ubatches == 2 and both.connector_extra_config == {"payload": "shared"}
    assert bt._afd_spec(ns, "async+shared").ubatches == 1
    gpu = bt._afd_spec(ns, "async+cuda_ipc")
    assert gpu.connector_extra_config == {"payload": "cuda_ipc"}


@pytest.mark.parametrize(
    "entry",
    ["p2p+stages", "async+x", "async+shared+shared", "async+shared+cuda_ipc"],
)
def test_an_unknown_connector_variant_is_refused_before_any_server_starts(
    capsys, entry
):
    args = build_parser().parse_args(["bench-ttft", "m", "--connectors", entry])
    assert bt.run_bench_ttft(args) == 2
    err = capsys.readouterr().err
    assert f"--connectors entry {entry!r}" in err, err
    assert "the variants are async+stages, async+shared, async+cuda_ipc" in err, err


def test_each_run_has_a_cache_salt_vllm_accepts_and_failures_are_shown():
    assert bt.cache_salt("AFD async 1A2F", 2.5) == "AFD-async-1A2F-2.5"
    assert bt.cache_salt("a/b@c\\d", 1) == "a-b-c-d-1"
    row = {"target": bt.PLAIN, "rate": 1.0, **bt.figures([], 3, 1.0, 1.0)}
    row["first_error"] = "ServerError: HTTP 400: cache_salt is invalid"
    table = bt.format_table(bt.with_ratios([row]), 1000.0)
    assert "plain vLLM at 1 req/s: 3 failed, first: ServerError: HTTP 400" in table


def test_the_breakdown_is_the_counters_growth_per_completed_request():
    before = {
        ("afd_connector_wait_seconds", "attention"): 1.0,
        ("afd_ffn_compute_seconds", "ffn"): 2.0,
        ("afd_a2f_bytes", "attention"): 0.0,
    }
    after = {
        ("afd_connector_wait_seconds", "attention"): 1.5,
        ("afd_ffn_compute_seconds", "ffn"): 2.2,
        ("afd_a2f_bytes", "attention"): 4 * 2**20,
    }
    parts = bt.breakdown(before, after, completed=4)
    assert parts == pytest.approx({"wait_ms": 125.0, "ffn_ms": 50.0, "a2f_mib": 1.0})
    assert bt.breakdown(before, after, completed=0)["wait_ms"] is None
    row = {"target": "AFD async 1A2F", "rate": 2.0, **bt.figures([0.2], 0, 1.0, 1.0)}
    table = bt.format_table(bt.with_ratios([{**row, **parts}]), 1000.0)
    assert "wait    125.0 ms  ffn     50.0 ms  a2f    1.00 MiB" in table


def test_a_mixed_workload_draws_its_decode_requests_and_reports_their_tpot():
    import random

    from vllm_afd.cli.bench_workload import RequestResult

    decode = bt.decode_indices(20, 0.25, random.Random(1))
    assert len(decode) == 5 and decode <= set(range(20))
    assert decode == bt.decode_indices(20, 0.25, random.Random(1))  # seeded
    assert bt.decode_indices(20, 0.0, random.Random(1)) == set()
    results = [
        RequestResult(0, 8, 4, token_gaps_s=(0.01, 0.03, 0.02)),  # TPOT 20 ms
        RequestResult(1, 8, 4, token_gaps_s=(0.04, 0.04, 0.04)),  # TPOT 40 ms
        RequestResult(2, 8, 0, error="HTTPError: 503"),
        RequestResult(3, 900, 1, ttft_s=0.5),  # a long prompt: not counted
    ]
    row = bt.tpot_figures(results, {0, 1, 2})
    assert (row["decode_requests"], row["decode_failed"]) == (3, 1)
    assert row["tpot_p50_ms"] == pytest.approx(30.0)
    assert row["tpot_p90_ms"] == pytest.approx(38.0)
    table = bt.format_table(
        bt.with_ratios([{"target": bt.PLAIN, "rate": 1.0,
                         **bt.figures([0.5], 0, 1.0, 1.0), **row}]),
        1000.0,
    )  # fmt: skip
    assert "decode requests of the mixed workload: TPOT p50, p90 (ms), failed" in table
    assert "30.0" in table and "1 of 3" in table


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--decode-share", "1"], "--decode-share=1 must be at least 0 and below 1"),
        (
            ["--decode-share", "0.01", "--num-requests", "10"],
            "--decode-share=0.01 of --num-requests=10 is no request",
        ),
        (
            ["--decode-share", "0.5", "--decode-output-len", "fixed:1"],
            "--decode-output-len=fixed:1 must give every decode request 2 new",
        ),
        (["--decode-share", "0.5", "--decode-input-len", "x:1"], "decode_input_len"),
    ],
)
def test_bad_mixed_workload_flags_are_refused_before_any_server_starts(
    capsys, flags, message
):
    args = build_parser().parse_args(["bench-ttft", "m", *flags])
    assert bt.run_bench_ttft(args) == 2
    assert message in capsys.readouterr().err
