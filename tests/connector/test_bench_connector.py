"""``tools/bench_connector.py`` end to end on CPU: two processes, the p2p
connector and a raw Gloo group echo real tensors; a short run must finish,
verify every echo (the tool asserts it) and report one row per size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_connector_reports_a_ratio_per_size(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    cmd = [
        sys.executable, str(ROOT / "tools" / "bench_connector.py"),
        "--tokens", "1", "3", "--hidden", "64", "--iters", "70", "--warmup", "2",
        "--json", str(out),
    ]  # fmt: skip
    # 70 iterations span two 64-layer steps: a step plan mid-run is covered.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ratio connector/raw: median" in done.stdout
    rows = json.loads(out.read_text())
    assert [(r["tokens"], r["hidden"], r["mode"]) for r in rows] == [
        (1, 64, "eager"),
        (3, 64, "eager"),
    ]
    for r in rows:
        assert r["raw_us"] > 0 and r["connector_us"] > 0
        assert abs(r["ratio"] - r["connector_us"] / r["raw_us"]) < 1e-9


def test_bench_connector_stops_at_its_time_limit_and_refuses_bad_dtype() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    tool = [sys.executable, str(ROOT / "tools" / "bench_connector.py")]
    short = [*tool, "--tokens", "1", "--hidden", "64", "--timeout", "0.5"]
    done = subprocess.run(short, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 1
    assert "no results from the attention process after 0.5 s" in done.stderr
    bad = subprocess.run(
        [*tool, "--dtype", "bf16"], capture_output=True, text=True, timeout=60, env=env
    )
    assert bad.returncode == 2 and "--dtype bf16 is not a torch dtype" in bad.stderr
