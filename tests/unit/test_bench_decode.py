"""The GPU decode benchmark's arithmetic (``tools/gpu/bench_decode.py``):
medians of repeats and the ratios it prints. Runs on CPU; the benchmark
itself needs two GPUs."""

from __future__ import annotations

import json
import os

import pytest


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


def test_profile_batch_must_be_a_measured_batch(bench, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        bench.main(["--out", "x.json", "--batches", "16,32", "--profile-batch", "64"])
    assert e.value.code == 2
    assert "--profile-batch 64 is not one of --batches" in capsys.readouterr().err


def test_profile_env_is_set_only_with_a_batch(bench, monkeypatch, tmp_path) -> None:
    names = ("DIR", "TOKENS", "MODES", "STEPS")
    for name in (f"AFD_PROFILE_{n}" for n in names):
        monkeypatch.setenv(name, "")  # restored (unset) after the test
        monkeypatch.delenv(name)
    assert bench._profile_env(tmp_path, None, True) == {}
    assert bench._profile_env(tmp_path, 8, False)["AFD_PROFILE_MODES"] == "EAGER"
    env = bench._profile_env(tmp_path / "t", 64, True)
    assert env == {
        "AFD_PROFILE_DIR": str(tmp_path / "t"),
        "AFD_PROFILE_TOKENS": "64",
        "AFD_PROFILE_MODES": "REPLAY",
        "AFD_PROFILE_STEPS": "20",
    }
    assert all(os.environ[k] == v for k, v in env.items())


def test_overlap_reads_both_traces_or_says_why_not(bench, tmp_path) -> None:
    missing = bench.overlap(tmp_path, 27)
    assert "attention-rank0-pid*.json" in missing["error"]
    events = []
    for role, corr, (start, end) in (
        ("attention", 1, (100, 300)),
        ("ffn", 2, (150, 250)),
    ):
        events = [
            {"ph": "X", "cat": "user_annotation", "ts": 0, "dur": 50,
             "name": f"afd_{role}_step#0 step=3 tokens=64 mode=REPLAY"},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 10,
             "dur": 1, "args": {"correlation": corr}},
            {"ph": "X", "cat": "kernel", "name": "gemm", "ts": start,
             "dur": end - start, "args": {"correlation": corr}},
        ]  # fmt: skip
        path = tmp_path / f"{role}-rank0-pid{corr}.json"
        path.write_text(json.dumps({"traceEvents": events}))
    found = bench.overlap(tmp_path, 27)
    (group,) = found["groups"]
    assert group["tokens"] == "64" and group["steps"] == 1
    assert group["step_us"] == 200 and group["efficiency"] == 1.0
    assert group["both_us"] == 100 and len(found["steps"]) == 1
