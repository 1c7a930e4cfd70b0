"""``tools/gpu/overlap_report.py`` on real torch.profiler traces of CUDA graph
replays.

Two processes stand in for the roles, one per GPU: each records labelled
steps with ``StepProfiler`` (``tokens`` filter, a CAPTURE step first) and
replays a CUDA graph of matmuls per step, the two released together by a
barrier. The report must find every recorded step in both traces and tie
each role's kernels to its steps. Unlike real roles, which NCCL couples, the
stand-ins are only released together, so one of them may start a step late:
that the two GPUs compute at once is checked on the steps' medians (the
attention's graph is the longer one, so the FFN's runs inside its window).

Also runnable by hand on any CUDA host (one GPU: ``--devices 0,0``)::

    python tests/gpu/test_overlap_report_gpu.py OUTDIR --devices 0,1
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

TOOL = Path(__file__).resolve().parents[2] / "tools" / "gpu" / "overlap_report.py"
STEPS = 6
TOKENS = 64


def _role(role: str, device: int, out_dir: str, barrier, matmuls: int) -> None:
    import torch

    from vllm_afd.connector.protocol import ExecMode, StepPlan
    from vllm_afd.worker.profiling import StepProfiler

    torch.cuda.set_device(device)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        y @ w  # cuBLAS warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(matmuls):
            y = y @ w
    prof = StepProfiler(role, 0, out_dir=out_dir, steps=STEPS, tokens=TOKENS)
    for step_id in range(1, STEPS + 3):
        mode = ExecMode.CAPTURE if step_id == 1 else ExecMode.REPLAY
        prof.step(StepPlan(step_id, mode, (TOKENS // 2, TOKENS // 2)))
        barrier.wait(timeout=120)
        graph.replay()
        torch.cuda.synchronize()
    prof.close()


def run_roles(out_dir: Path, devices: tuple[int, int]) -> tuple[list, list, dict]:
    """Trace both stand-in roles, then report: (rows, groups, FFN steps)."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    roles = (("attention", devices[0], 8), ("ffn", devices[1], 4))  # matmuls
    procs = [
        ctx.Process(target=_role, args=(role, dev, str(out_dir), barrier, n))
        for role, dev, n in roles
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0, f"stand-in role exited with {p.exitcode}"
    spec = importlib.util.spec_from_file_location("overlap_report", TOOL)
    rep = importlib.util.module_from_spec(spec)
    sys.modules["overlap_report"] = rep  # dataclasses look their module up
    spec.loader.exec_module(rep)
    rows, groups, _, ffn_path = rep.report_traces(directory=out_dir)
    print(rep.table(groups, None))
    return rows, groups, rep.load_steps(ffn_path, "ffn")


def test_overlap_report_reads_real_graph_replay_traces(tmp_path: Path) -> None:
    rows, groups, ffn_steps = run_roles(tmp_path, (0, 1))
    recorded = list(range(2, STEPS + 2))
    assert [r["step_id"] for r in rows] == recorded
    (group,) = groups
    assert (group["tokens"], group["mode"], group["steps"]) == (
        f"{TOKENS // 2}+{TOKENS // 2}",
        "REPLAY",
        STEPS,
    )
    for r in rows:
        assert 0 < r["attention_us"] <= r["step_us"]
        assert 0 < r["efficiency"] <= 1.0
    # every FFN step has the kernels of its own graph replay
    assert all(ffn_steps[sid].compute for sid in recorded)
    # different GPUs, released together: the FFN's shorter graph runs while
    # the attention's runs
    assert group["ffn_us"] > 0 and group["both_us"] > 0.5 * group["ffn_us"]


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    devs = "0,1"
    if "--devices" in sys.argv:
        devs = sys.argv[sys.argv.index("--devices") + 1]
    first, second = (int(d) for d in devs.split(","))
    found, _, _ = run_roles(out, (first, second))
    for row in found:
        print(row)
