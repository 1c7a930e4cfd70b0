"""The terminal table of a ``vllm-afd bench`` report (``format_table``).

Reads the report :mod:`vllm_afd.cli.bench_report` builds; writes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_afd.cli.bench_report import (
    MIN_SAMPLES,
    PERCENTILES,
    REPEATED,
    provenance_line,
)


def num(value: Any, fmt: str = ",.1f") -> str:
    return "-" if value is None else format(value, fmt)


def _pct(fraction: float | None, fmt: str) -> str:
    return "-" if fraction is None else f"{format(fraction * 100, fmt)}%"


def minmedmax(dist: dict[str, Any]) -> str:
    if not dist.get("count"):
        return "-"
    return f"{dist['min']:g}/{dist['median']:g}/{dist['max']:g}"


def _headline(report: dict[str, Any]) -> list[str]:
    cfg, model, work = report["config"], report["model"], report["workload"]
    pace = []
    if cfg.get("request_rate"):
        pace.append(f"Poisson arrivals {cfg['request_rate']:g} req/s")
    if cfg.get("concurrency"):
        pace.append(f"concurrency {cfg['concurrency']}")
    layers = model.get("remote_layers")
    versus = "plain vLLM"
    if cfg.get("prefill"):
        versus = f"{cfg['baseline_label']}, and {cfg['reference_label']}"
    return [
        f"vllm-afd bench: AFD {cfg['deployment']} (A:F {cfg['af_ratio']}, "
        f"{cfg.get('connector') or '?'}) vs {versus} -- {model.get('name')}",
        f"workload: {cfg['num_requests']} requests, {', '.join(pace)}, "
        f"seed {cfg['seed']}; "
        f"input len {minmedmax(work['input_len'])}, output len "
        f"{minmedmax(work['output_len'])} (min/median/max)",
        f"layers: {model.get('num_remote_layers', '?')} of "
        f"{model.get('num_hidden_layers', '?')} remote "
        f"{list(layers) if layers is not None else ''}, hidden "
        f"{model.get('hidden_size', '?')}, {model.get('dtype', '?')}",
    ]


def _run_rows(report: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    afd, base = report["afd"], report["baseline"] or {}
    cmp_ = report["comparison"]
    ratio = cmp_.get

    def pair(key: str, fmt: str = ",.1f") -> tuple[str, str]:
        return num(afd.get(key), fmt), num(base.get(key), fmt)

    rows = [
        (
            "requests ok",
            f"{afd['requests'] - afd['failed']}/{afd['requests']}",
            f"{base['requests'] - base['failed']}/{base['requests']}" if base else "-",
            "",
        ),
        ("devices (role processes)", *pair("devices", "d"), ""),
        (
            "output throughput (tok/s)",
            *pair("output_throughput"),
            num(ratio("throughput_ratio"), ".3f"),
        ),
        (
            "  per device (tok/s)",
            *pair("throughput_per_device"),
            num(ratio("throughput_per_device_ratio"), ".3f"),
        ),
        _overhead_row(report.get("overhead")),
    ]
    for metric, label in (("ttft", "TTFT"), ("tpot", "TPOT")):
        for q in PERCENTILES:
            a_dist, b_dist = afd[f"{metric}_ms"], base.get(f"{metric}_ms", {})
            rows.append(
                (
                    f"{label} p{q} (ms)",
                    _marked(a_dist, f"p{q}"),
                    _marked(b_dist, f"p{q}"),
                    num(ratio(f"{metric}_p{q}_ratio"), ".3f"),
                )
            )
    if base:
        rows.append(
            (
                "greedy output = baseline",
                "",
                "",
                f"{cmp_['agreeing_requests']}/{afd['requests']} = "
                f"{cmp_['agreement']:.3f}",
            )
        )
    return rows


def _counter_lines(c: dict[str, Any]) -> list[str]:
    lines = [
        "AFD counters (deltas over the workload; per attention step unless noted)",
        f"  steps                 attention {c['attention_steps']:,.0f}, "
        f"ffn {c['ffn_steps']:,.0f}; tokens through FFN "
        f"{c['tokens_through_ffn']:,.0f}",
        f"  batch (tokens/step)   {num(c['batch_tokens_per_step'])} (FFN)",
        f"  A2F bytes / step      {num(c['a2f_bytes_per_step'], ',.0f')}  "
        f"per layer {num(c['a2f_bytes_per_layer_step'], ',.0f')}  "
        f"per token-layer {num(c['a2f_bytes_per_token_layer'], ',.1f')} "
        f"(expected {num(c['expected_a2f_bytes_per_token_layer'], 'd')})",
        f"  F2A bytes / step      {num(c['f2a_bytes_per_step'], ',.0f')}  "
        f"per layer {num(c['f2a_bytes_per_layer_step'], ',.0f')}",
        f"  connector wait / step {num(c['connector_wait_ms_per_step'], '.3f')} ms "
        f"(attention, for F2A), {num(c['ffn_connector_wait_ms_per_step'], '.3f')}"
        " ms (FFN, for A2F)",
        f"  FFN compute / step    {num(c['ffn_compute_ms_per_step'], '.3f')} ms",
        f"  wall time / step      {num(c['wall_ms_per_step'], '.3f')} ms "
        "(workload duration / attention steps)",
        f"  errors                {c['errors']:.0f}",
        "  per rank:",
    ]
    for r in c["per_rank"]:
        line = (
            f"    {r['role']:9s} {r['rank']}: steps {r['steps']:,.0f}, batch "
            f"{num(r['batch_tokens_per_step'])} tok/step, wait "
            f"{num(r['connector_wait_ms_per_step'], '.3f')} ms/step"
        )
        if r["ffn_compute_ms_per_step"] is not None:
            line += f", compute {r['ffn_compute_ms_per_step']:.3f} ms/step"
        lines.append(line)
    return lines


def _marked(dist: Mapping[str, Any], key: str) -> str:
    """A percentile cell; ``~`` marks one over fewer than MIN_SAMPLES values."""
    text = num(dist.get(key), ",.2f")
    return f"~{text}" if dist.get("few_samples") and text != "-" else text


def _overhead_row(o: dict[str, Any] | None) -> tuple[str, str, str, str]:
    """Beside the throughput it lowers: what streaming measurement costs."""
    if not o:
        return ("  bench overhead", "not measured", "not measured", "")
    return (
        "  bench overhead (streaming)",
        "",
        f"{_pct(o['throughput_overhead'], '+.1f')} of it",
        "",
    )


def _overhead_line(o: dict[str, Any] | None) -> list[str]:
    if not o:
        return ["bench overhead: not measured (no baseline, or --skip-overhead)"]
    return [
        f"bench overhead ({o['server']}): per-token streaming measurement costs "
        f"{_pct(o['throughput_overhead'], '+.1f')} of output "
        f"throughput (streamed {o['streamed_throughput']:,.1f} vs plain "
        f"{o['plain_throughput']:,.1f} tok/s); client CPU "
        f"{o['client_cpu_s_streamed']:.2f} s = "
        f"{_pct(o['client_cpu_share_streamed'], '.1f')} of one core; the AFD "
        "side streams alike, so the ratios hold and absolute figures are low "
        "by about that much",
    ]


def _repeat_lines(r: dict[str, Any] | None) -> list[str]:
    if not r:
        return []
    lines = [f"repeats: {r['count']} runs per side, median [min, max]"]
    for name, _ in REPEATED:
        fig = r[name]

        def cell(spread: Mapping[str, Any] | None, fmt: str) -> str:
            if not spread or spread["median"] is None:
                return "-"
            return (
                f"{spread['median']:{fmt}} [{spread['min']:{fmt}}, "
                f"{spread['max']:{fmt}}]"
            )

        lines.append(
            f"  {name:24s} AFD {cell(fig['afd'], ',.2f')}  baseline "
            f"{cell(fig['baseline'], ',.2f')}  ratio {cell(fig['ratio'], '.3f')}"
        )
    return lines


def _reference_lines(report: dict[str, Any]) -> list[str]:
    """The third server's figures and AFD/its ratios (``--prefill``: plain
    vLLM without PD), under the table."""
    ref = report.get("reference")
    if not ref:
        return []
    label = report["config"].get("reference_label") or "reference"
    fig, ratio = ref["figures"], ref["comparison"]
    lines = [
        f"{label} on the same requests: "
        f"{fig['requests'] - fig['failed']}/{fig['requests']} ok, output "
        f"{num(fig['output_throughput'])} tok/s (AFD/{label} "
        f"{num(ratio['throughput_ratio'], '.3f')})"
    ]
    for metric, name in (("ttft", "TTFT"), ("tpot", "TPOT")):
        cells = [
            f"p{q} {_marked(fig[f'{metric}_ms'], f'p{q}')} ms "
            f"({num(ratio[f'{metric}_p{q}_ratio'], '.3f')})"
            for q in PERCENTILES
        ]
        lines.append(f"  {name} " + ", ".join(cells) + f" (AFD/{label} in brackets)")
    lines.append(
        f"  greedy output = {label}: {ratio['agreeing_requests']}/"
        f"{report['afd']['requests']}"
    )
    return [*lines, ""]


def run_names(cfg: dict[str, Any], baseline: str = "plain vLLM") -> tuple[str, str]:
    """The AFD run's and the baseline's names (``vllm-afd bench --prefill``
    names both sides of PD); ``baseline`` where the config names none."""
    name = cfg.get("afd_label") or f"AFD {cfg['deployment']}"
    return name, cfg.get("baseline_label") or baseline


def format_table(report: dict[str, Any]) -> str:
    """The report as a terminal table."""
    name, base = run_names(report["config"], baseline="baseline")
    rows = [("", name, base, "AFD/baseline"), *_run_rows(report)]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    body = [
        f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  "
        f"{r[3]:>{widths[3]}}".rstrip()
        for r in rows
    ]
    return "\n".join(
        [
            *_headline(report),
            "",
            *body,
            "",
            *_reference_lines(report),
            *_counter_lines(report["counters"]),
            "",
            *_overhead_line(report["overhead"]),
            *_repeat_lines(report.get("repeats")),
            f"~: a percentile over fewer than {MIN_SAMPLES} requests",
            provenance_line(report.get("provenance")),
        ]
    )
