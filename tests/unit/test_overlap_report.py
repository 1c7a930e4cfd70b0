"""``tools/gpu/overlap_report.py``: per-step GPU time of each role from the
step profiler's traces. Synthetic Chrome traces shaped like torch.profiler's
(GPU activity tied to the launching CUDA call by its correlation id), and a
real CPU trace of ``StepProfiler`` for the step labels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_afd.connector.protocol import ExecMode, StepPlan
from vllm_afd.worker.profiling import StepProfiler, step_label


class Trace:
    """A Chrome trace of one role: step ranges, launches, GPU activity."""

    def __init__(self, role: str) -> None:
        self.role, self.events, self._corr, self._k = role, [], 0, 0

    def step(self, ts: float, dur: float, step_id: int, tokens="16", mode="REPLAY"):
        label = f"step={step_id} tokens={tokens} mode={mode}"
        name = f"afd_{self.role}_step#{self._k} {label}"
        self._k += 1
        for cat, at in (("user_annotation", ts), ("gpu_user_annotation", ts + 999)):
            # torch draws the range on the host and again on the GPU timeline
            self.events.append(
                {"ph": "X", "cat": cat, "name": name, "ts": at, "dur": dur}
            )

    def launch(self, at: float, *gpu: tuple[str, float, float]) -> None:
        """One CUDA call at ``at`` (a graph launch) and the GPU work it ran."""
        self._corr += 1
        c = {"correlation": self._corr}
        self.events.append(
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch",
             "ts": at, "dur": 1.0, "args": c}
        )  # fmt: skip
        for name, start, end in gpu:
            cat = "gpu_memcpy" if name == "Memcpy DtoH" else "kernel"
            self.events.append(
                {"ph": "X", "cat": cat, "name": name, "ts": start,
                 "dur": end - start, "args": c}
            )  # fmt: skip

    def write(self, directory: Path, pid: int) -> Path:
        path = directory / f"{self.role}-rank0-pid{pid}.json"
        path.write_text(json.dumps({"traceEvents": self.events}))
        return path


def test_interval_arithmetic(rep) -> None:
    assert rep.union([(5, 7), (0, 2), (1, 3)]) == [(0, 3), (5, 7)]
    assert rep.length([(0, 2), (1, 3), (10, 11)]) == 4
    assert rep.intersect([(0, 10)], [(2, 3), (8, 12)]) == [(2, 3), (8, 10)]


def _deployment(tmp_path: Path) -> tuple[Path, Path]:
    att, ffn = Trace("attention"), Trace("ffn")
    # Step 7, one micro-batch: attention computes, waits in NCCL while the FFN
    # computes, computes again; a copy of the sampled ids ends it.
    att.step(0, 50, 7)
    att.launch(
        10,
        ("gemm", 1000, 1100),
        ("ncclDevKernel_SendRecv", 1100, 1300),
        ("gemm", 1300, 1340),
        ("Memcpy DtoH", 1340, 1350),
    )
    ffn.step(5, 40, 7)
    ffn.launch(20, ("ncclDevKernel_SendRecv", 990, 1160), ("moe", 1160, 1280))
    # Step 8, two micro-batches: the FFN computes micro-batch 0 while the
    # attention computes micro-batch 1.
    att.step(2000, 50, 8, tokens="8+8")
    att.launch(2010, ("gemm", 3000, 3100), ("gemm", 3120, 3220))
    ffn.step(2005, 40, 8, tokens="8+8")
    ffn.launch(2020, ("moe", 3100, 3200), ("moe", 3230, 3300), ("moe", 3400, 3500))
    # Step 9 only in the attention trace (the FFN stopped recording); a launch
    # outside every step range is not counted.
    att.step(4000, 50, 9)
    att.launch(4010, ("gemm", 5000, 5100))
    ffn.launch(4020, ("moe", 5000, 5100))
    return att.write(tmp_path, 11), ffn.write(tmp_path, 12)


def test_steps_matched_by_id_with_busy_overlap_and_idle_time(rep, tmp_path) -> None:
    att_path, ffn_path = _deployment(tmp_path)
    rows, groups = rep.report(
        rep.load_steps(att_path, "attention"), rep.load_steps(ffn_path, "ffn")
    )
    assert [r["step_id"] for r in rows] == [7, 8]
    serial, split = rows
    assert serial["step_us"] == 350 and serial["attention_us"] == 150
    # the NCCL kernels (the FFN waits there for the A2F) are not compute
    assert serial["ffn_us"] == 120 and serial["both_us"] == 0
    assert serial["attention_nccl_us"] == 200 and serial["ffn_nccl_us"] == 170
    assert serial["efficiency"] == pytest.approx(150 / 350)
    assert serial["neither_share"] == pytest.approx(80 / 350)
    # window 3000-3220: FFN 3100-3200 and 3230-3300 clipped to the window
    assert split["step_us"] == 220 and split["attention_us"] == 200
    assert split["ffn_us"] == 100 and split["both_us"] == 80
    assert split["efficiency"] == pytest.approx(200 / 220)
    assert split["neither_share"] == pytest.approx(0.0)
    assert [(g["tokens"], g["steps"]) for g in groups] == [("16", 1), ("8+8", 1)]


def test_cli_prints_groups_and_writes_json(rep, tmp_path, capsys) -> None:
    _deployment(tmp_path)
    out = tmp_path / "report.json"
    assert rep.main([str(tmp_path), "--layers", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 steps in both traces" in text and "us/layer" in text
    assert "0.43" in text  # step 7's efficiency
    data = json.loads(out.read_text())
    assert len(data["steps"]) == 2 and len(data["groups"]) == 2


def test_cli_errors_name_what_is_missing(rep, tmp_path, capsys) -> None:
    assert rep.main([str(tmp_path)]) == 2
    assert "need exactly one attention-rank0-pid*.json trace, found none" in (
        capsys.readouterr().err
    )
    att, ffn = Trace("attention"), Trace("ffn")
    att.step(0, 10, 1)
    att.launch(1, ("gemm", 5, 6))
    ffn.step(0, 10, 2)
    ffn.launch(1, ("moe", 5, 6))
    att_path, ffn_path = att.write(tmp_path, 1), ffn.write(tmp_path, 2)
    assert rep.main(["--attention", str(att_path), "--ffn", str(ffn_path)]) == 1
    assert "no step was recorded by both roles" in capsys.readouterr().err


def test_real_cpu_trace_has_parsable_labels_but_no_gpu_activity(rep, tmp_path) -> None:
    prof = StepProfiler("ffn", 0, out_dir=tmp_path, steps=2)
    plans = [StepPlan(41, ExecMode.EAGER, (3,)), StepPlan(42, ExecMode.REPLAY, (2, 2))]
    for plan in plans:
        prof.step(plan)
    prof.step()
    assert step_label(plans[1]) == "step=42 tokens=2+2 mode=REPLAY"
    with pytest.raises(ValueError, match="no GPU activity"):
        rep.load_steps(prof.path, "ffn")
    with pytest.raises(ValueError, match="no afd_attention_step ranges"):
        rep.load_steps(prof.path, "attention")
    names = {e["name"] for e in json.loads(prof.path.read_text())["traceEvents"]}
    assert {"afd_ffn_step#0 step=41 tokens=3 mode=EAGER",
            "afd_ffn_step#1 step=42 tokens=2+2 mode=REPLAY"} <= names  # fmt: skip
