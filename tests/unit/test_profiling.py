"""Unit tests for the per-role step profiler (vllm_afd.worker.profiling)."""

from __future__ import annotations

import json
import os

import torch

from vllm_afd import envs
from vllm_afd.worker.profiling import StepProfiler


def _work() -> None:
    torch.randn(16, 16) @ torch.randn(16, 16)


def _trace_steps(path) -> list[str]:
    events = json.loads(path.read_text())["traceEvents"]
    return sorted({e["name"] for e in events if "afd_ffn_step#" in e.get("name", "")})


def test_step_profiler_off_without_profile_dir(monkeypatch, tmp_path):
    monkeypatch.delenv(envs.AFD_PROFILE_DIR, raising=False)
    prof = StepProfiler("attention", 0)
    for _ in range(3):
        prof.step()
    prof.close()
    assert not prof.enabled and prof.path is None


def test_step_profiler_records_n_steps_then_exports_chrome_trace(monkeypatch, tmp_path):
    monkeypatch.setenv(envs.AFD_PROFILE_DIR, str(tmp_path / "traces"))
    monkeypatch.setenv(envs.AFD_PROFILE_STEPS, "3")
    prof = StepProfiler("ffn", 1)
    for _ in range(3):
        prof.step()
        _work()
    assert prof.enabled and not (tmp_path / "traces").exists()
    prof.step()  # closes step 3: exports
    assert not prof.enabled
    path = tmp_path / "traces" / f"ffn-rank1-pid{os.getpid()}.json"
    assert prof.path == path
    assert _trace_steps(path) == ["afd_ffn_step#0", "afd_ffn_step#1", "afd_ffn_step#2"]
    prof.step()  # later calls are no-ops
    prof.close()


def test_step_profiler_close_exports_partial_trace_after_skip(tmp_path):
    prof = StepProfiler("ffn", 0, out_dir=tmp_path, steps=10, skip=2)
    for _ in range(4):  # 2 skipped, 2 recorded
        prof.step()
        _work()
    prof.close()
    assert _trace_steps(prof.path) == ["afd_ffn_step#0", "afd_ffn_step#1"]


def test_step_profiler_tokens_waits_for_a_served_step_of_that_size(
    monkeypatch, tmp_path
):
    from vllm_afd.connector.protocol import ExecMode, StepPlan

    monkeypatch.setenv(envs.AFD_PROFILE_TOKENS, "4")
    prof = StepProfiler("ffn", 0, out_dir=tmp_path, steps=2, skip=1)
    plans = [
        StepPlan(1, ExecMode.REPLAY, (4,)),  # skipped by count
        StepPlan(2, ExecMode.WARMUP, (4,)),  # warm-up: not a served step
        StepPlan(3, ExecMode.CAPTURE, (2, 2)),  # a graph capture
        StepPlan(4, ExecMode.EAGER, (3,)),  # another size
        StepPlan(5, ExecMode.REPLAY, (2, 2)),  # first match: recording starts
        StepPlan(6, ExecMode.EAGER, (7,)),  # recorded whatever its size
        StepPlan(7, ExecMode.REPLAY, (4,)),  # exports
    ]
    import threading

    for plan in plans:
        assert prof.enabled
        prof.step(plan)
        if plan.step_id == 6:  # another thread (a micro-batch's) is ignored
            other = threading.Thread(target=prof.step, args=(plans[0],))
            other.start()
            other.join()
        _work()
    assert not prof.enabled
    assert _trace_steps(prof.path) == [
        "afd_ffn_step#0 step=5 tokens=2+2 mode=REPLAY",
        "afd_ffn_step#1 step=6 tokens=7 mode=EAGER",
    ]


def test_step_profiler_modes_narrow_the_start(tmp_path):
    from vllm_afd.connector.protocol import ExecMode, StepPlan

    prof = StepProfiler(
        "ffn", 0, out_dir=tmp_path, steps=1, tokens=4, modes=("REPLAY",)
    )
    prof.step(StepPlan(1, ExecMode.EAGER, (4,)))  # a start-up run: not counted
    prof.step(StepPlan(2, ExecMode.REPLAY, (4,)))
    _work()
    prof.step(StepPlan(3, ExecMode.REPLAY, (4,)))
    assert _trace_steps(prof.path) == ["afd_ffn_step#0 step=2 tokens=4 mode=REPLAY"]


def test_step_profiler_close_writes_only_on_the_tracing_thread(tmp_path, caplog):
    import threading

    prof = StepProfiler("ffn", 0, out_dir=tmp_path, steps=10)
    traced, closed_elsewhere = threading.Event(), threading.Event()

    def tracer() -> None:
        prof.step()
        _work()
        prof.step()
        traced.set()
        assert closed_elsewhere.wait(30)
        prof.close()  # the tracing thread: writes the partial trace

    worker = threading.Thread(target=tracer)
    worker.start()
    assert traced.wait(30)
    prof.close()  # another thread: must not touch torch's profiler
    assert prof.enabled and not prof.path.exists()
    assert "1 recorded ffn steps (rank 0) not written yet" in caplog.text
    closed_elsewhere.set()
    worker.join(30)
    assert not prof.enabled
    assert _trace_steps(prof.path) == ["afd_ffn_step#0", "afd_ffn_step#1"]
