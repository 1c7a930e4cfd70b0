"""Per-step GPU time of each role, read from ``AFD_PROFILE_DIR`` traces, and
the overlap efficiency of micro-batches.

Record a few steps of a running 1A1F deployment on GPUs (both roles need
the variables; ``vllm-afd launch`` passes its environment on), then read the
two traces::

    AFD_PROFILE_DIR=traces AFD_PROFILE_SKIP=200 AFD_PROFILE_STEPS=40 \\
        vllm-afd launch MODEL --attention-devices 0 --ffn-devices 1 -- ...
    # ... load, until both roles wrote their trace ...
    python tools/gpu/overlap_report.py traces [--layers 27] [--json out.json]

Each role's trace holds its ``afd_{role}_step#k step=ID tokens=N mode=M``
ranges (``vllm_afd.worker.profiling``) and the GPU activity they launched,
CUDA graph replays included: a kernel belongs to the step whose range holds
the CUDA call that launched it. Steps are matched across roles by step id.
Per step:

* ``step_us``: the attention GPU's span, first activity to last;
* ``attention_us``, ``ffn_us``: time the role's GPU computes, as the union of
  its kernels, copies and memsets, NCCL kernels excluded (they include waiting);
* ``efficiency``: max(attention_us, ffn_us) / step_us, the overlap efficiency
  of the max(attention, FFN) model (1.0: the step takes as long as the busier
  GPU alone; a serial step of equal halves is near 0.5);
* ``both_us``: time both GPUs compute at once (overlap; only micro-batches
  make it non-zero);
* ``neither_share``: the share of ``step_us`` in which neither GPU computes:
  transfers not hidden, plus launch and synchronisation gaps (an upper bound
  of the unhidden transfer share).

Steps are grouped by (tokens, mode); a group's figures are medians.
Timestamps of both traces are the host's monotonic clock (one host).

Dimensions: none; times in microseconds.
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

_STEP = re.compile(
    r"^afd_(?P<role>attention|ffn)_step#\d+ step=(?P<id>\d+) "
    r"tokens=(?P<tokens>[\d+]+) mode=(?P<mode>\w+)$"
)
_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")

Interval = tuple[float, float]


@dataclass
class StepTrace:
    """The GPU activity one role launched in one step."""

    step_id: int
    tokens: str
    mode: str
    compute: list[Interval] = field(default_factory=list)
    nccl: list[Interval] = field(default_factory=list)


def union(intervals: list[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time."""
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in union(intervals))


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The time covered by both ``a`` and ``b``."""
    out = []
    a, b = union(a), union(b)
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def load_steps(path: Path, role: str) -> dict[int, StepTrace]:
    """Steps of one role's Chrome trace, by step id, with their GPU activity.

    Raises ValueError when the trace holds no labelled step of ``role`` or
    no GPU activity (a CPU trace, or CUDA activity not recorded).
    """
    events = json.loads(path.read_text())["traceEvents"]
    ranges = []  # (start, end, StepTrace)
    for e in events:
        m = _STEP.match(e.get("name", ""))
        # the host range; torch also draws it on the GPU (gpu_user_annotation)
        if m and m["role"] == role and e.get("cat") == "user_annotation":
            step = StepTrace(int(m["id"]), m["tokens"], m["mode"])
            ranges.append((e["ts"], e["ts"] + e["dur"], step))
    if not ranges:
        raise ValueError(
            f"{path}: no afd_{role}_step ranges with a step label; record with "
            "AFD_PROFILE_DIR on a vllm-afd that labels steps"
        )
    ranges.sort(key=lambda r: r[0])
    starts = [r[0] for r in ranges]
    launches = {}  # correlation id -> launch time (CUDA runtime call)
    for e in events:
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e["ts"]
    gpu_events = 0
    for e in events:
        if e.get("cat") not in _GPU_CATS or e.get("ph") != "X":
            continue
        gpu_events += 1
        at = launches.get(e.get("args", {}).get("correlation"))
        if at is None:
            continue
        i = bisect.bisect_right(starts, at) - 1
        if i < 0 or at > ranges[i][1]:
            continue  # launched outside every recorded step
        step = ranges[i][2]
        span = (e["ts"], e["ts"] + e["dur"])
        is_nccl = e["cat"] == "kernel" and e["name"].lower().startswith("nccl")
        (step.nccl if is_nccl else step.compute).append(span)
    if gpu_events == 0:
        raise ValueError(
            f"{path}: no GPU activity in the trace (a CPU run, or CUDA activity "
            "was not recorded)"
        )
    return {r[2].step_id: r[2] for r in ranges}


def step_row(att: StepTrace, ffn: StepTrace) -> dict | None:
    """The figures of one step seen by both roles; None if the attention GPU
    ran nothing in it."""
    gpu = att.compute + att.nccl
    if not gpu:
        return None
    window = [(min(s for s, _ in gpu), max(e for _, e in gpu))]
    step_us = window[0][1] - window[0][0]
    att_c, ffn_c = att.compute, intersect(ffn.compute, window)
    att_us, ffn_us = length(att_c), length(ffn_c)
    busy = length(att_c + ffn_c)
    return {
        "step_id": att.step_id,
        "tokens": att.tokens,
        "mode": att.mode,
        "step_us": step_us,
        "attention_us": att_us,
        "ffn_us": ffn_us,
        "both_us": length(intersect(att_c, ffn_c)),
        "attention_nccl_us": length(att.nccl),
        "ffn_nccl_us": length(ffn.nccl),
        "efficiency": max(att_us, ffn_us) / step_us if step_us else 0.0,
        "neither_share": (step_us - busy) / step_us if step_us else 0.0,
    }


def report(
    attention: dict[int, StepTrace], ffn: dict[int, StepTrace]
) -> tuple[list[dict], list[dict]]:
    """(per-step rows, per-(tokens, mode) groups of medians)."""
    rows = [
        row
        for sid in sorted(attention.keys() & ffn.keys())
        if (row := step_row(attention[sid], ffn[sid])) is not None
    ]
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["tokens"], row["mode"]), []).append(row)
    keys = ("step_us", "attention_us", "ffn_us", "both_us", "efficiency",
            "neither_share")  # fmt: skip
    summary = [
        {"tokens": t, "mode": m, "steps": len(g)}
        | {k: statistics.median(r[k] for r in g) for k in keys}
        for (t, m), g in sorted(groups.items(), key=lambda kv: -len(kv[1]))
    ]
    return rows, summary


def report_traces(
    attention: Path | None = None,
    ffn: Path | None = None,
    directory: Path | None = None,
) -> tuple[list[dict], list[dict], Path, Path]:
    """:func:`report` of two trace files, each given or found in
    ``directory``: (rows, groups, attention file, FFN file).

    Raises ValueError (a trace missing, ambiguous or without labelled steps
    or GPU activity) or OSError (unreadable).
    """
    att_path = attention or find_trace(directory, "attention")
    ffn_path = ffn or find_trace(directory, "ffn")
    rows, groups = report(
        load_steps(att_path, "attention"), load_steps(ffn_path, "ffn")
    )
    return rows, groups, att_path, ffn_path


def table(summary: list[dict], layers: int | None) -> str:
    head = (
        f"{'tokens':>10} {'mode':>7} {'steps':>5} {'step us':>9} {'attn us':>9} "
        f"{'ffn us':>9} {'both us':>8} {'effic.':>6} {'neither':>7}"
    )
    if layers:
        head += f" {'us/layer':>8}"
    lines = [head, "-" * len(head)]
    for g in summary:
        line = (
            f"{g['tokens']:>10} {g['mode']:>7} {g['steps']:>5} {g['step_us']:>9.1f} "
            f"{g['attention_us']:>9.1f} {g['ffn_us']:>9.1f} {g['both_us']:>8.1f} "
            f"{g['efficiency']:>6.2f} {g['neither_share']:>7.2f}"
        )
        if layers:
            line += f" {g['step_us'] / layers:>8.1f}"
        lines.append(line)
    return "\n".join(lines)


def find_trace(directory: Path, role: str) -> Path:
    found = sorted(directory.glob(f"{role}-rank0-pid*.json"))
    if len(found) != 1:
        names = ", ".join(p.name for p in found) or "none"
        raise ValueError(
            f"{directory}: need exactly one {role}-rank0-pid*.json trace, found "
            f"{names} (pass --{role} FILE)"
        )
    return found[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", type=Path, nargs="?", help="the AFD_PROFILE_DIR")
    p.add_argument("--attention", type=Path, help="the attention trace file")
    p.add_argument("--ffn", type=Path, help="the FFN trace file")
    p.add_argument("--layers", type=int, help="decoder layers: adds us/layer")
    p.add_argument("--json", metavar="PATH", help="also write steps and groups")
    args = p.parse_args(argv)
    if args.traces is None and not (args.attention and args.ffn):
        p.error("give the traces directory, or --attention and --ffn")
    try:
        rows, summary, att_path, ffn_path = report_traces(
            args.attention, args.ffn, args.traces
        )
    except (ValueError, OSError) as e:
        print(f"overlap_report: {e}", file=sys.stderr)
        return 2
    if not rows:
        print("overlap_report: no step was recorded by both roles", file=sys.stderr)
        return 1
    print(f"{len(rows)} steps in both traces ({att_path.name}, {ffn_path.name})")
    print(table(summary, args.layers))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": rows, "groups": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
