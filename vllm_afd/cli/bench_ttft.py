"""``vllm-afd bench-ttft``: time to first token under load, side by side.

Plain vLLM, then each AFD connector asked for, on the same model, hardware
and settings, one after another; for every request rate a Poisson stream of
``--num-requests`` prefill-heavy requests (``--input-len`` prompt tokens,
``--output-len`` new tokens, default 1: prefill only)::

    rate  target               TTFT p50  p90  p99 ms  SLO  req/s  p50 vs plain
    2.0   plain vLLM               ...
    2.0   AFD p2p 1A1F             ...
    2.0   AFD async 1A2F           ...

For an AFD target each row also holds where a request's time went, from
the roles' AFD counters (``/metrics``) over that rate's run, per completed
request: ``wait_ms`` (attention ranks' host time blocked on the connector:
dispatch, the FFN ranks' work and the combine's wait together),
``ffn_ms`` (FFN ranks' compute, summed over ranks) and ``a2f_mib``
(attention-to-FFN payload).

A mixed workload (``--decode-share``) puts decode requests (a short prompt,
``--decode-output-len`` new tokens) into the same stream: the TTFT figures
are then the long prompts', and each row also holds the decode requests'
TPOT p50 and p90 (``tpot_p50_ms``, ``tpot_p90_ms``): what a long prefill
costs the decoding requests beside it.

Each (target, rate) run uses prompts of its own prefix-cache salt, so no
run reads another's cached prefixes. The synchronous connector (``p2p``)
runs with the gate on attention and at most A FFN ranks (it needs A >= F);
``async`` runs the topology given. Ratios are taken within this one run:
quote them, not the absolute times, on a shared or noisy host.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import sys
from pathlib import Path
from typing import Any

from vllm_afd.cli.bench_workload import (
    Request,
    build_requests,
    model_info,
    parse_lengths,
    run_requests,
    timed_request,
)
from vllm_afd.cli.client import afd_metrics
from vllm_afd.cli.launch import add_cpu_bind_flag
from vllm_afd.config import DEFAULT_PORT
from vllm_afd.connector.factory import ASYNC_SLOT_PAYLOADS
from vllm_afd.deploy import Deployment, DeploymentSpec, LaunchError, PlainServer
from vllm_afd.deploy.logs import new_log_dir

PLAIN = "plain vLLM"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench-ttft",
        help="time to first token under load: plain vLLM and AFD connectors",
        description="Start plain vLLM, then an AFD deployment per connector, "
        "on the same model; send each a Poisson stream of long-prompt requests "
        "at every rate; report TTFT percentiles, SLO attainment and ratios to "
        "plain vLLM. Arguments after `--` go to every `vllm serve` it starts.",
    )
    p.add_argument("model", help="model directory, as for vllm serve")
    p.add_argument("-A", "--attention-ranks", type=int, default=1)
    p.add_argument("-F", "--ffn-ranks", type=int, default=1)
    p.add_argument(
        "--connectors",
        default="p2p,async",
        help="comma-separated AFD connectors to compare with plain vLLM "
        "(default p2p,async; async+stages: async with afd.num_ubatches 2; "
        "async+shared: its payloads in shared memory; async+cuda_ipc: in GPU "
        "memory; a payload plane and stages combine, e.g. async+shared+stages)",
    )
    p.add_argument(
        "--rates", default="1,2,4", help="comma-separated request rates, req/s"
    )
    p.add_argument("--num-requests", type=int, default=24, help="per rate")
    p.add_argument("--input-len", default="fixed:256", help="fixed:N, uniform:A:B")
    p.add_argument("--output-len", default="fixed:1", help="fixed:N (1: prefill)")
    p.add_argument(
        "--decode-share",
        type=float,
        default=0.0,
        help="mixed workload: this share of each rate's requests (0 to 1, "
        "exclusive) are decode requests (--decode-input-len prompt, "
        "--decode-output-len new tokens) in the same Poisson stream; their "
        "TPOT is reported beside the long prompts' TTFT",
    )
    p.add_argument(
        "--decode-input-len", default="fixed:32", help="fixed:N, uniform:A:B"
    )
    p.add_argument("--decode-output-len", default="fixed:64", help="fixed:N (>= 2)")
    p.add_argument(
        "--slo-ms", type=float, default=1000.0, help="TTFT SLO for attainment"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--afd-port", type=int, default=DEFAULT_PORT)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    add_cpu_bind_flag(p)
    p.add_argument("--json", help="write the figures as JSON here")
    p.add_argument("--plot-dir", help="write a PNG plot here (needs matplotlib)")
    p.add_argument("-v", "--verbose", action="store_true", help="servers' logs")
    p.set_defaults(vllm_args=[])  # main() puts everything after `--` here
    p.set_defaults(func=run_bench_ttft)


def _note(text: str) -> None:
    print(f"vllm-afd bench-ttft: {text}", file=sys.stderr, flush=True)


def _check_mix(args: argparse.Namespace) -> None:
    """The mixed workload's flags make sense, or ValueError naming them."""
    share = args.decode_share
    if not 0 <= share < 1:
        raise ValueError(f"--decode-share={share:g} must be at least 0 and below 1")
    if share == 0:
        return
    if round(share * args.num_requests) == 0:
        raise ValueError(
            f"--decode-share={share:g} of --num-requests={args.num_requests} is "
            "no request: raise either"
        )
    parse_lengths(args.decode_input_len, "decode_input_len")
    out = parse_lengths(args.decode_output_len, "decode_output_len")
    if min(out.sample(64, random.Random(0))) < 2:
        raise ValueError(
            f"--decode-output-len={args.decode_output_len} must give every decode "
            "request 2 new tokens at least (a TPOT is a gap between two)"
        )


def _floats(flag: str, text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(
            f"{flag}={text!r} is not a comma-separated list of numbers"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{flag}={text!r} needs positive numbers")
    return values


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between closest ranks."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    at = (len(ordered) - 1) * q / 100
    lo = int(at)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (at - lo)


def decode_indices(n: int, share: float, rng: random.Random) -> set[int]:
    """Which of ``n`` requests are the decode requests of a mixed workload:
    ``round(share * n)`` of them, drawn by ``rng``, spread over the stream."""
    return set(rng.sample(range(n), round(share * n)))


def tpot_figures(results: list, decode: set[int]) -> dict:
    """The decode requests' figures: each request's TPOT (its mean gap
    between two streamed tokens), their p50 and p90 over the requests (ms),
    and how many of them were sent and failed."""
    mine = [r for r in results if r.index in decode]
    tpots = [sum(r.token_gaps_s) / len(r.token_gaps_s) for r in mine
             if r.error is None and r.token_gaps_s]  # fmt: skip
    return {
        "decode_requests": len(mine),
        "decode_failed": sum(r.error is not None for r in mine),
        "tpot_p50_ms": percentile(tpots, 50) * 1e3 if tpots else None,
        "tpot_p90_ms": percentile(tpots, 90) * 1e3 if tpots else None,
    }


def figures(ttfts: list[float], failed: int, duration_s: float, slo_s: float) -> dict:
    """TTFT percentiles (ms), SLO attainment over every request sent (a
    failed one misses it) and completed requests per second."""
    sent = len(ttfts) + failed
    return {
        "requests": sent,
        "failed": failed,
        "ttft_p50_ms": percentile(ttfts, 50) * 1e3 if ttfts else None,
        "ttft_p90_ms": percentile(ttfts, 90) * 1e3 if ttfts else None,
        "ttft_p99_ms": percentile(ttfts, 99) * 1e3 if ttfts else None,
        "slo_attainment": sum(t <= slo_s for t in ttfts) / sent if sent else 0.0,
        "requests_per_s": len(ttfts) / duration_s if duration_s else 0.0,
    }


#: (row key, AFD counter, role, scale): the per-request breakdown of a row
BREAKDOWN = (
    ("wait_ms", "afd_connector_wait_seconds", "attention", 1e3),
    ("ffn_ms", "afd_ffn_compute_seconds", "ffn", 1e3),
    ("a2f_mib", "afd_a2f_bytes", "attention", 1 / 2**20),
)


def afd_counters(urls: list[str]) -> dict[tuple[str, str], float]:
    """The AFD counters of every role endpoint in ``urls``, summed over
    ranks: {(name, role): value}."""
    totals: dict[tuple[str, str], float] = {}
    for url in urls:
        for (name, role, _rank), value in afd_metrics(url).items():
            totals[name, role] = totals.get((name, role), 0.0) + value
    return totals


def breakdown(
    before: dict[tuple[str, str], float],
    after: dict[tuple[str, str], float],
    completed: int,
) -> dict[str, float | None]:
    """Per completed request, the counters' growth between two reads."""
    row: dict[str, float | None] = {}
    for key, name, role, scale in BREAKDOWN:
        grown = after.get((name, role), 0.0) - before.get((name, role), 0.0)
        row[key] = grown * scale / completed if completed else None
    return row


def _measure(
    url: str,
    name: str,
    args: argparse.Namespace,
    rates: list[float],
    role_urls: list[str] | None = None,
) -> list:
    served, _ = model_info(url)
    rng = random.Random(args.seed)
    n = args.num_requests
    ins = parse_lengths(args.input_len, "input_len").sample(n, rng)
    outs = parse_lengths(args.output_len, "output_len").sample(n, rng)
    decode = decode_indices(n, args.decode_share, random.Random(args.seed + 1))
    if decode:  # the mixed workload: these requests decode, the rest prefill
        d_in = parse_lengths(args.decode_input_len, "decode_input_len")
        d_out = parse_lengths(args.decode_output_len, "decode_output_len")
        d_rng = random.Random(args.seed + 2)
        for i in sorted(decode):
            ins[i] = d_in.sample(1, d_rng)[0]
            outs[i] = d_out.sample(1, d_rng)[0]
    base = build_requests(url, served, ins, outs, args.seed)
    for req in base[: args.warmup]:
        warm = Request(0, req.prompt[::-1], 1, salt="warm-up")
        timed_request(url, served, warm, stream=True)
    rows = []
    for rate in rates:
        salted = [dataclasses.replace(r, salt=cache_salt(name, rate)) for r in base]
        _note(f"{name}: {n} requests at {rate:g} req/s ...")
        before = afd_counters(role_urls) if role_urls else None
        run = run_requests(
            name, url, served, salted, concurrency=None, rate=rate,
            seed=args.seed, progress=False,
        )  # fmt: skip
        long = [r for r in run.requests if r.index not in decode]
        ttfts = [r.ttft_s for r in long if r.error is None and r.ttft_s is not None]
        failed = len(long) - len(ttfts)
        row = figures(ttfts, failed, run.duration_s, args.slo_ms / 1e3)
        if decode:
            row.update(tpot_figures(list(run.requests), decode))
        if before is not None and role_urls:
            row.update(breakdown(before, afd_counters(role_urls), len(ttfts)))
        error = next((r.error for r in run.requests if r.error), None)
        rows.append({"target": name, "rate": rate, **row, "first_error": error})
    return rows


def cache_salt(target: str, rate: float) -> str:
    """The prefix-cache salt of one (target, rate) run: vLLM refuses ``@``,
    ``/``, ``\\`` and more than 128 characters."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{target}-{rate:g}")[:128]


#: the variants that pick the connector option ``payload`` (one at most)
PAYLOAD_VARIANTS = ASYNC_SLOT_PAYLOADS
#: the ``--connectors`` variants of ``async``: what each adds
ASYNC_VARIANTS = ("stages", *PAYLOAD_VARIANTS)


def _afd_spec(args: argparse.Namespace, connector: str) -> DeploymentSpec:
    """The deployment of one ``--connectors`` entry: a connector, or ``async``
    with variants joined by ``+``: ``stages`` (``afd.num_ubatches`` 2),
    ``shared`` or ``cuda_ipc`` (connector option ``payload``), e.g.
    ``async+shared+stages``."""
    connector, *variants = connector.split("+")
    wrong = [v for v in variants if v not in ASYNC_VARIANTS or variants.count(v) > 1]
    planes = [v for v in variants if v in PAYLOAD_VARIANTS]
    if variants and (connector != "async" or wrong or len(planes) > 1):
        raise ValueError(
            f"--connectors entry {'+'.join([connector, *variants])!r}: the "
            f"variants are async+{', async+'.join(ASYNC_VARIANTS)}, one payload "
            "plane with or without stages (e.g. async+shared+stages)"
        )
    ffn = args.ffn_ranks
    if connector != "async":
        ffn = min(ffn, args.attention_ranks)  # the synchronous topology: A >= F
    options = {"payload": planes[0]} if planes else {}
    return DeploymentSpec(
        model=args.model, attention_ranks=args.attention_ranks, ffn_ranks=ffn,
        port=args.port, afd_port=args.afd_port, connector=connector,
        gate_on_attention=True, vllm_args=list(args.vllm_args),
        ready_timeout_s=args.ready_timeout,
        ubatches=2 if "stages" in variants else 1,
        cpu_bind=getattr(args, "cpu_bind", "vllm"),
        connector_extra_config=options,
    ).with_default_devices()  # fmt: skip


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row with ``p50_vs_plain``: its TTFT p50 over plain vLLM's at
    the same rate (None without both)."""
    plain = {r["rate"]: r["ttft_p50_ms"] for r in rows if r["target"] == PLAIN}
    out = []
    for r in rows:
        base, mine = plain.get(r["rate"]), r["ttft_p50_ms"]
        ratio = mine / base if base and mine is not None else None
        out.append({**r, "p50_vs_plain": ratio})
    return out


def format_table(rows: list[dict], slo_ms: float) -> str:
    def ms(v: float | None) -> str:
        return f"{v:8.1f}" if v is not None else "       -"

    w = max([18, *(len(r["target"]) for r in rows)])  # the target column
    lines = [
        f"{'rate':>6}  {'target':<{w}} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} "
        f"{'SLO':>5} {'req/s':>6} {'failed':>6}  p50 vs plain",
    ]
    for r in sorted(rows, key=lambda r: r["rate"]):
        ratio = r["p50_vs_plain"]
        lines.append(
            f"{r['rate']:>6g}  {r['target']:<{w}} {ms(r['ttft_p50_ms'])} "
            f"{ms(r['ttft_p90_ms'])} {ms(r['ttft_p99_ms'])} "
            f"{r['slo_attainment']:>5.0%} {r['requests_per_s']:>6.2f} "
            f"{r['failed']:>6}  {f'{ratio:.2f}x' if ratio is not None else '-'}"
        )
    lines.append(f"SLO: TTFT <= {slo_ms:g} ms (failed requests miss it)")
    mixed = [r for r in rows if r.get("decode_requests")]
    if mixed:
        lines.append(
            "decode requests of the mixed workload: TPOT p50, p90 (ms), failed"
        )
        for r in sorted(mixed, key=lambda r: (r["rate"], r["target"])):
            lines.append(
                f"{r['rate']:>6g}  {r['target']:<{w}} {ms(r['tpot_p50_ms'])} "
                f"{ms(r['tpot_p90_ms'])} {r['decode_failed']:>6} of "
                f"{r['decode_requests']}"
            )
    parts = [r for r in rows if r.get("wait_ms") is not None]
    if parts:
        lines.append("per request (AFD counters): connector wait, FFN compute, A2F")
        for r in sorted(parts, key=lambda r: (r["rate"], r["target"])):
            lines.append(
                f"{r['rate']:>6g}  {r['target']:<{w}} wait {r['wait_ms']:8.1f} ms  "
                f"ffn {r['ffn_ms']:8.1f} ms  a2f {r['a2f_mib']:7.2f} MiB"
            )
    for r in rows:
        if r.get("first_error"):
            lines.append(
                f"{r['target']} at {r['rate']:g} req/s: {r['failed']} failed, "
                f"first: {r['first_error']}"
            )
    return "\n".join(lines)


def plot(rows: list[dict], out_dir: str) -> Path | None:
    """TTFT p50 and p90 against the request rate, one line per target."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for target in dict.fromkeys(r["target"] for r in rows):
        mine = sorted(
            (r for r in rows if r["target"] == target), key=lambda r: r["rate"]
        )
        rates = [r["rate"] for r in mine]
        line = ax.plot(
            rates, [r["ttft_p50_ms"] for r in mine], marker="o", label=f"{target} p50"
        )
        ax.plot(rates, [r["ttft_p90_ms"] for r in mine], linestyle="--",
                color=line[0].get_color(), label=f"{target} p90")  # fmt: skip
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("Time to first token under load")
    ax.legend(fontsize=7)
    path = Path(out_dir) / "ttft.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_bench_ttft(args: argparse.Namespace) -> int:
    try:
        rates = _floats("--rates", args.rates)
        connectors = [c.strip() for c in args.connectors.split(",") if c.strip()]
        if args.num_requests <= 0:
            raise ValueError(f"--num-requests={args.num_requests} must be positive")
        _check_mix(args)
        for connector in connectors:
            _afd_spec(args, connector)  # refuses an unknown variant now
    except ValueError as exc:
        _note(str(exc))
        return 2
    log_dir = new_log_dir()
    _note(f"role logs in {log_dir}")
    sink = sys.stderr if args.verbose else None
    rows: list[dict[str, Any]] = []
    try:
        base = _afd_spec(args, "p2p")
        _note("starting plain vLLM ...")
        with PlainServer(base, log=sink, log_dir=log_dir) as plain:
            rows += _measure(plain.url, PLAIN, args, rates)
        for connector in connectors:
            spec = _afd_spec(args, connector)
            name = f"AFD {connector} {spec.attention_ranks}A{spec.ffn_ranks}F"
            _note(f"starting {name} ...")
            dep = Deployment(spec, log=sink, log_dir=log_dir)
            dep.start(args.ready_timeout)
            try:
                urls = [dep.api_url, *(p.url for p in dep.ffns)]
                rows += _measure(dep.api_url, name, args, rates, urls)
            finally:
                dep.stop()
    except (LaunchError, ValueError, OSError) as exc:
        _note(f"failed: {exc}")
        return 1
    rows = with_ratios(rows)
    print(format_table(rows, args.slo_ms), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=2))
        _note(f"wrote {args.json}")
    if args.plot_dir:
        path = plot(rows, args.plot_dir)
        _note(f"wrote {path}" if path else "matplotlib not installed: no plot")
    return 1 if any(r["failed"] for r in rows) else 0
