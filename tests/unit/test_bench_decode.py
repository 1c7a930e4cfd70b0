"""The GPU decode benchmark's arithmetic (``tools/gpu/bench_decode.py``):
medians of repeats and the ratios it prints. Runs on CPU; the benchmark
itself needs two GPUs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "tools" / "gpu" / "bench_decode.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_decode", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_decode"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["bench_decode"]


def row(setup: str, batch: int, tok_per_s: float) -> dict:
    return {"setup": setup, "batch": batch, "tok_per_s": tok_per_s}


def test_batch_row_takes_the_median_wall_time(bench) -> None:
    r = bench.batch_row(64, [(8192, 2.0), (8192, 9.0), (8192, 1.0)], 128)
    assert r["wall_s"] == 2.0
    assert r["tok_per_s"] == 8192 / 2.0
    assert r["ms_per_step"] == pytest.approx(1e3 * 2.0 / 128)
    assert r["wall_s_samples"] == [1.0, 2.0, 9.0]


def test_ratios_against_best_baseline_no_split_and_halves(bench) -> None:
    rows = [
        row("afd-1a1f", 32, 300.0),
        row("afd-1a1f", 64, 500.0),
        row("afd-1a1f-ub2", 64, 450.0),
        row("plain-tp2", 64, 1000.0),
        row("plain-dp2ep2", 64, 800.0),
    ]
    got = {(r["batch"], r["setup"], r["best"]): r["ratio"] for r in bench.ratios(rows)}
    assert got == {
        (64, "afd-1a1f", "plain-tp2"): 0.5,
        (64, "afd-1a1f-ub2", "plain-tp2"): 0.45,
        (64, "afd-1a1f-ub2", "afd-1a1f"): 0.9,
        # two 32-token steps back to back give afd-1a1f's B=32 throughput
        (64, "afd-1a1f-ub2", "afd-1a1f B/2 twice"): 1.5,
    }
