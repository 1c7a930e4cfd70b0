"""Plots of ``vllm-afd bench`` (``bench.png``) and ``vllm-afd plan``
(tokens/s per device against A:F), with matplotlib when it is installed.

Each function returns what it wrote, or a false value without matplotlib.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_afd.cli.bench_format import minmedmax, num, run_names
from vllm_afd.cli.bench_report import PERCENTILES, provenance_line

if TYPE_CHECKING:
    from vllm_afd.cli.plan_model import Plan, Prediction


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` on the file-only Agg backend; None without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _paired(ax: Any, title: str, labels: list[str], series: list, names: list) -> None:
    """Bars per label, one per run; AFD/baseline ratio written above a pair."""
    width = 0.8 / len(series)
    for i, (values, name) in enumerate(zip(series, names, strict=True)):
        xs = [x - 0.4 + width * (i + 0.5) for x in range(len(labels))]
        ax.bar(xs, [v or 0.0 for v in values], width, label=name)
    if len(series) == 2:
        for x, (a, b) in enumerate(zip(*series, strict=True)):
            if a and b:
                top = max(a, b)
                ax.text(x, top * 1.02, f"x{a / b:.2f}", ha="center", va="bottom")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.15)


def _step_panel(ax: Any, c: dict[str, Any], name: str) -> None:
    parts = [
        ("FFN: wait for A2F", c["ffn_connector_wait_ms_per_step"]),
        ("FFN: compute", c["ffn_compute_ms_per_step"]),
        ("attention: wait for F2A", c["connector_wait_ms_per_step"]),
        ("wall time / step", c["wall_ms_per_step"]),
    ]
    values = [v or 0.0 for _, v in parts]
    ax.barh([p for p, _ in parts], values, color=["C2", "C2", "C0", "C7"])
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.1f}", va="center")
    ax.margins(x=0.15)
    ax.set_title(
        f"{name} per step (ms): batch {num(c['batch_tokens_per_step'])} tokens, "
        f"A2F {num((c['a2f_bytes_per_step'] or 0) / 1024)} KiB",
        fontsize=10,
    )


def plot_report(report: dict[str, Any], out_dir: str | Path) -> Path | None:
    """Write ``bench.png``: latency, throughput, AFD step time (needs matplotlib).

    Returns the path, or None when matplotlib is not installed.
    """
    plt = pyplot()
    if plt is None:
        return None
    cfg, afd, base = report["config"], report["afd"], report["baseline"]
    name, base_name = run_names(cfg)
    runs = [(name, afd)] + ([(base_name, base)] if base else [])
    names = [n for n, _ in runs]
    pct = [f"p{q}" for q in PERCENTILES]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, key, title in (
        (axes[0][0], "ttft_ms", "TTFT (ms, lower is better)"),
        (axes[0][1], "tpot_ms", "TPOT (ms, lower is better)"),
    ):
        _paired(ax, title, pct, [[r[key].get(k) for k in pct] for _, r in runs], names)
    keys = ("output_throughput", "throughput_per_device")
    _paired(
        axes[1][0],
        "output throughput (tokens/s, higher is better)",
        ["total", "per device"],
        [[r[k] for k in keys] for _, r in runs],
        names,
    )
    _step_panel(axes[1][1], report["counters"], name)
    work, cmp_ = report["workload"], report["comparison"]
    fig.suptitle(
        f"vllm-afd bench: {name} (A:F {cfg['af_ratio']}) vs {base_name}; "
        f"{cfg['num_requests']} requests, input len {minmedmax(work['input_len'])}, "
        f"output len {minmedmax(work['output_len'])} (min/median/max)\n"
        f"vllm serve {' '.join(cfg.get('vllm_args') or [])}\n"
        f"throughput ratio {num(cmp_.get('throughput_ratio'), '.2f')}, "
        f"greedy output = baseline for {num(cmp_.get('agreement'), '.0%')} of "
        "requests; x = AFD / baseline\n"
        f"{provenance_line(report.get('provenance'))}",
        fontsize=9,
    )
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.915), ncol=2)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_plan(plan: Plan, path: str, unit: str, title: str) -> bool:
    """Tokens/s per device against A:F (the best deployment at each A:F,
    named), one line per context and micro-batch count, colocated as a
    dotted reference; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in plan.contexts:
        for m in sorted({_m(p) for p in plan.rows}):
            best: dict[float, Prediction] = {}  # per A:F, the best deployment
            for p in plan.rows:
                r = _ratio(p)
                if (
                    p.context == c
                    and _m(p) == m
                    and (
                        r not in best
                        or p.tokens_per_s_per_device > best[r].tokens_per_s_per_device
                    )
                ):
                    best[r] = p
            if best:
                xs = sorted(best)
                ys = [best[r].tokens_per_s_per_device for r in xs]
                style = "-o" if m == 1 else "--s"
                ax.plot(xs, ys, style, label=f"context {c}, m={m}")
                for r, y in zip(xs, ys, strict=True):
                    cand = best[r].candidate
                    assert cand is not None  # rows are AFD deployments
                    ax.annotate(
                        dataclasses.replace(cand, ubatches=1).name,
                        (r, y),
                        fontsize=6,
                        textcoords="offset points",
                        xytext=(3, 3),
                    )
        base = plan.baselines.get(c)
        if base:
            ax.axhline(base.tokens_per_s_per_device, linestyle=":", color="grey")
            ax.annotate(f"{base.name}, context {c}",
                        (0.02, base.tokens_per_s_per_device),
                        xycoords=("axes fraction", "data"), fontsize=7)  # fmt: skip
    ax.set_xlabel("A:F (attention ranks per FFN rank)")
    ax.set_ylabel(unit)
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _m(p: Prediction) -> int:
    return p.candidate.ubatches if p.candidate else 1


def _ratio(p: Prediction) -> float:
    c = p.candidate
    return c.attention_ranks / c.ffn_ranks if c else 0.0
