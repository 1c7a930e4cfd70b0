"""The tables ``vllm-afd plan`` prints: measured parts, plan, check (pure)."""

from __future__ import annotations

import statistics
from typing import Any

from vllm_afd.cli.plan_fit import SPREAD_LIMIT
from vllm_afd.cli.plan_model import Link, Plan, Profile


def _spread(point: dict | None) -> str:
    """A point's step spread over its repeats, ``*`` when still wide."""
    if point is None or point.get("samples", 1) < 2:
        return "-"
    mark = "*" if point["spread"] > SPREAD_LIMIT else ""
    return f"{point['spread']:.0%}{mark}"


def format_profile(
    prof: Profile, afd: list[dict], plain_points: list[dict] | None = None
) -> str:
    layers = prof.remote_layers or 1
    every = [*afd, *(plain_points or [])]
    repeated = any(p.get("samples", 1) > 1 for p in every)
    plain_at = {(p["context"], p["batch"]): p for p in plain_points or []}
    lines = [
        f"measured parts per decode step ({prof.remote_layers} remote layers; "
        "per layer = / layers)",
        f"{'context':>8} {'batch':>6} {'T_a ms':>8} {'T_f ms':>8} {'T_c ms':>8} "
        f"{'T_f/layer us':>13} {'plain ms':>9}"
        + "".join(f" {f'S{k} ms':>7}" for k in sorted(prof.sharing))
        + (f" {'U ms':>7}" if prof.ubatching else "")
        + (f" {'spread':>7} {'plain':>6}" if repeated else ""),
    ]
    for p in afd:
        c, b = p["context"], p["batch"]
        t_a = prof.attention[c](b)
        t_f, t_c = prof.ffn(b), prof.comm(b)
        plain = prof.colocated.get(c)
        shares = [prof.sharing[k].get(c) for k in sorted(prof.sharing)]
        ub = prof.ubatching.get(c)
        lines.append(
            f"{c:>8} {b:>6} {t_a * 1e3:>8.2f} {t_f * 1e3:>8.2f} {t_c * 1e3:>8.2f} "
            f"{t_f / layers * 1e6:>13.1f} "
            f"{plain(b) * 1e3 if plain else float('nan'):>9.2f}"
            + "".join(f" {s(b) * 1e3 if s else float('nan'):>7.2f}" for s in shares)
            + (f" {ub(b) * 1e3:>7.2f}" if ub else "")
            + (
                f" {_spread(p):>7} {_spread(plain_at.get((c, b))):>6}"
                if repeated
                else ""
            )
        )
    own = {(p["context"], p["batch"]) for p in afd}
    extra = [p for p in plain_points or [] if (p["context"], p["batch"]) not in own]
    if extra:
        lines.append(
            "plain ms at the batches the kA1F deployments hold on this device: "
            + ", ".join(
                f"context {p['context']} batch {p['batch']} "
                f"{prof.colocated[p['context']](p['batch']) * 1e3:.2f}"
                + (f" (spread {_spread(p)})" if repeated else "")
                for p in extra
            )
        )
    if repeated:
        lines.append(
            "spread: (max - min) / median of a step over the repeats (AFD, "
            f"plain vLLM); above {SPREAD_LIMIT:.0%} a point is measured again "
            "as many times, * marks one still that wide"
        )
    if prof.sharing:
        lines.append(
            "Sk: what attention rank k costs a step on this shared device "
            "beyond its work (measured on kA1F; negative: the ranks overlap)"
        )
    if prof.ubatching:
        lines.append(
            "U: what each micro-batch beyond the first changes the step by "
            "(measured on 1A1F with 2; negative: the overlap gains)"
        )
    kv = (prof.kv_tokens_attention, prof.kv_tokens_colocated)
    lines.append(f"KV capacity (tokens): attention rank {kv[0]}, colocated {kv[1]}")
    for n, curves in sorted(prof.colocated_tp.items()):
        steps = ", ".join(
            f"context {c} batch {int(b)}: {t * 1e3:.2f} ms"
            for c, curve in sorted(curves.items())
            for b, t in curve.points
        )
        kv_n = prof.kv_tokens_colocated_tp.get(n)
        lines.append(f"plain vLLM TP{n} step: {steps}; KV capacity {kv_n}")
    return "\n".join(lines)


def format_plan(plan: Plan, unit: str) -> str:
    equal = {id(p): q for p, q in zip(plan.rows, plan.equal, strict=False)}
    lines = [
        f"{'context':>8} {'deployment':<12} {'batch':>6} {'step ms':>8} "
        f"{unit:>14} {'vs colocated':>13} {'same batch':>14} bound",
    ]
    for c in plan.contexts:
        base = plan.baselines.get(c)
        rows = sorted(
            (p for p in plan.rows if p.context == c),
            key=lambda p: -p.tokens_per_s_per_device,
        )
        for p in [*rows, *([base] if base else [])]:
            ratio = (
                f"{p.tokens_per_s_per_device / base.tokens_per_s_per_device:.2f}x"
                if base and p is not base else "1.00x" if p is base else "-"
            )  # fmt: skip
            same = equal.get(id(p))
            vs_same = (
                f"{p.tokens_per_s_per_device / same.tokens_per_s_per_device:.2f}x"
                f" ({same.batch})" if same else "-"
            )  # fmt: skip
            lines.append(
                f"{c:>8} {p.name:<12} {p.batch:>6} {p.step_s * 1e3:>8.2f} "
                f"{p.tokens_per_s_per_device:>14.1f} {ratio:>13} {vs_same:>14} "
                f"{p.bound.value if p.bound else '-'}"
            )
    lines.append(
        "vs colocated: against plain vLLM at its best batch that fits (KV, SLO); "
        "same batch: against plain vLLM holding as many sequences per device "
        "(in brackets)"
    )
    for p in plan.over_bound:
        lines.append(
            f"{p.context:>8} {p.name:<12} {p.batch:>6} not trusted: {p.over_bound}"
        )
    rec = plan.recommended
    if rec is None:
        lines.append(f"recommended: none ({plan.reason})")
    else:
        lines.append(
            f"recommended: {rec.name}, batch {rec.batch} per attention rank "
            f"(context {rec.context}): {plan.reason}"
        )
    return "\n".join(lines)


#: characters of a failed check's reason in the table
FAILED_WIDTH = 100


def format_check(rows: list[dict[str, Any]], unit: str, plan: Plan) -> str:
    """The ``--check`` table: each deployment predicted and measured, or
    why it could not be measured; the median error and the best measured
    over the measured ones."""
    lines = [
        f"{'deployment':<12} {'batch':>6} {'step ms pred':>13} {'measured':>9} "
        f"{'error':>7} {unit + ' pred':>19} {'measured':>9}"
    ]
    for r in rows:
        head = f"{r['deployment']:<12} {r['batch']:>6} {r['predicted_step_ms']:>13.2f}"
        if "failed" in r:
            why = r["failed"].splitlines()[0] if r["failed"] else "no reason given"
            if len(why) > FAILED_WIDTH:
                why = why[: FAILED_WIDTH - 3] + "..."
            lines.append(f"{head} failed: {why}")
            continue
        lines.append(
            f"{head} {r['measured_step_ms']:>9.2f} {r['step_error'] * 100:>6.0f}% "
            f"{r['predicted_tokens_per_s_per_device']:>19.1f} "
            f"{r['measured_tokens_per_s_per_device']:>9.1f}"
        )
    measured = [r for r in rows if "failed" not in r]
    rec = plan.recommended.name if plan.recommended else None
    if measured:
        errors = [abs(r["step_error"]) for r in measured]
        best = max(measured, key=lambda r: r["measured_tokens_per_s_per_device"])
        failed = len(rows) - len(measured)
        lines.append(
            f"median |step error| {statistics.median(errors) * 100:.0f}%"
            f"{f' of {len(measured)} measured' if failed else ''}; best "
            f"measured: {best['deployment']} (recommended: {rec})"
        )
    elif rows:
        lines.append(f"no checked deployment could be measured (recommended: {rec})")
    return "\n".join(lines)


def format_scaled(plan: Plan, devices: int, link: Link) -> str:
    """The scale model's plan: every xAyF on ``devices`` separate devices."""
    head = (
        f"predicted on {devices} separate devices (a prediction from the parts "
        f"measured here, not checked on such hardware; link "
        f"{link.latency_s * 1e6:.1f} us one way, {link.bytes_per_s / 1e9:.0f} "
        f"GB/s, {link.bytes_per_token} bytes per token and layer)"
    )
    return head + "\n" + format_plan(plan, "tok/s/device")
