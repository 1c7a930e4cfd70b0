"""``vllm-afd bench``: an AFD deployment measured side by side with plain vLLM.

::

    vllm-afd bench --model DIR -A M -F N [workload] [-- vllm serve args…]
    vllm-afd bench --model DIR --prefill N|xAyF[:async] -A M -F N [workload] [-- …]
    vllm-afd bench --afd-url URL [--ffn-url URL] [--baseline-url URL]
                   [--reference-url URL] [workload]

With ``--model`` it starts the AFD deployment (``launch.Deployment``), runs
the workload, stops it, then starts plain vLLM on the same model, settings
and machine (``launch.PlainServer``) and runs the same requests: one after
the other, so both have the whole machine. With URLs it drives servers that
are already running. Phases per server: warm up, read the AFD counters, run
the workload (streamed, timed per token), read the counters again once they
settle. On the baseline the workload then runs once more without streaming
to measure the bench's own overhead.

With ``--prefill`` both sides are prefill/decode deployments behind vLLM's
router (``deploy.pd``): AFD as the decode side, against the same prefill side
with one plain vLLM decode server (the baseline); then plain vLLM without PD
runs the same requests as the reference (ratios AFD/reference beside the
table). ``--reference-url`` gives a running reference in URL mode. See
docs/benchmarks.md.

(Over 500 lines on purpose: its three modes, servers started here, PD
deployments and running servers, go through one sequence of phases per
server, kept in one place; the figures, the table and the plots are
modules of their own: ``bench_report``, ``bench_format``, ``plots``.)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import random
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from vllm_afd.cli import bench_format, plots
from vllm_afd.cli import bench_report as report_mod
from vllm_afd.cli.bench_workload import (
    Request,
    RunResult,
    build_requests,
    model_info,
    parse_lengths,
    run_requests,
    timed_request,
)
from vllm_afd.cli.client import afd_metrics
from vllm_afd.cli.launch import add_device_flags, add_topology_flags, parse_prefill_flag
from vllm_afd.config import DEFAULT_PORT
from vllm_afd.deploy import Deployment, DeploymentSpec, LaunchError, PlainServer
from vllm_afd.deploy.logs import new_log_dir
from vllm_afd.deploy.pd import PDDeployment, PDSpec, check_router_installed
from vllm_afd.models.layout import parse_model_line


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="decode benchmark against plain vLLM",
        description="Run a workload against AFD and a plain-vLLM baseline on the "
        "same model and hardware; report side-by-side ratios. Arguments after "
        "`--` go to every `vllm serve` it starts.",
    )
    t = p.add_argument_group("what to measure")
    t.add_argument("--model", help="model directory: start AFD and the baseline")
    t.add_argument("--afd-url", help="a running AFD deployment (attention API)")
    t.add_argument(
        "--ffn-url",
        action="append",
        default=[],
        help="an FFN rank's API server (FFN counters); repeat for every FFN rank",
    )
    t.add_argument("--baseline-url", help="a running plain vLLM on the same model")
    t.add_argument(
        "--prefill",
        type=parse_prefill_flag,
        default=0,
        metavar="N|xAyF[:async]",
        help="with --model: measure prefill/decode deployments behind vLLM's "
        "router (as launch --prefill): AFD as the decode side against PD with "
        "one plain vLLM decode server, then plain vLLM without PD as the "
        "reference",
    )
    t.add_argument(
        "--reference-url",
        help="a running server to compare with besides the baseline (plain "
        "vLLM when the other two are PD deployments)",
    )
    add_topology_flags(t)
    t.add_argument("--baseline-devices", type=int, default=1)
    t.add_argument("--connector", default="p2p")
    t.add_argument("--ubatches", type=int, default=1, help="afd.num_ubatches")
    t.add_argument("--port", type=int, default=8000, help="API port (launch mode)")
    t.add_argument("--ffn-port", type=int, default=None)
    t.add_argument("--afd-port", type=int, default=DEFAULT_PORT)
    add_device_flags(t)
    t.add_argument("--ready-timeout", type=float, default=600.0)
    t.add_argument("--server-log", help="write the servers' logs to this file")
    t.add_argument("-v", "--verbose", action="store_true", help="servers' logs")
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=64)
    w.add_argument("--concurrency", type=int, default=None, help="default 8")
    w.add_argument("--request-rate", type=float, default=None, help="req/s")
    w.add_argument("--input-len", default="uniform:32:256", help="fixed:N, ...")
    w.add_argument("--output-len", default="fixed:64", help="fixed:N, ...")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--warmup", type=int, default=2, help="unmeasured requests")
    w.add_argument(
        "--repeats", type=int, default=1,
        help="run the workload N times on each side (AFD, baseline, in turn) and "
        "report the median and spread of each figure (default 1)",
    )  # fmt: skip
    o = p.add_argument_group("output")
    o.add_argument("--json", help="write the report as JSON here")
    o.add_argument("--plot-dir", help="write PNG plots here (needs matplotlib)")
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--skip-overhead", action="store_true", help="skip the overhead run")
    p.set_defaults(vllm_args=[])  # main() puts everything after `--` here
    p.set_defaults(func=run_bench)


# ----------------------------------------------------------------- the model
def _dtype(vllm_args: list[str], config: dict[str, Any]) -> str | None:
    for i, arg in enumerate(vllm_args):
        value = None
        if arg == "--dtype" and i + 1 < len(vllm_args):
            value = vllm_args[i + 1]
        elif arg.startswith("--dtype="):
            value = arg.split("=", 1)[1]
        if value and value != "auto":
            return value
    return config.get("torch_dtype") or config.get("dtype")


def model_facts(
    model_dir: str | None,
    served: str,
    vllm_args: list[str],
    gate_on_attention: bool,
    split: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Layers, width and dtype of the served model.

    The layers that cross the connector come from ``split``, the attention
    role's own account of what vLLM built (its start-up log line); width and
    dtype from ``config.json`` where the model is local. Unknown facts are
    left out.
    """
    facts: dict[str, Any] = {"name": model_dir or served}
    path = Path(model_dir or served) / "config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    cfg = {**cfg.get("text_config", {}), **cfg}
    dtype = _dtype(vllm_args, cfg)
    size = report_mod.DTYPE_BYTES.get(str(dtype))
    hidden = split["hidden_size"] if split else cfg.get("hidden_size")
    per_token = None if size is None or hidden is None else hidden * size
    if per_token is not None and gate_on_attention:
        top_k = split["top_k"] if split else cfg.get("num_experts_per_tok", 0)
        per_token += top_k * 8  # fp32 weights, i32 ids
    facts.update(
        hidden_size=hidden,
        dtype=dtype,
        dtype_bytes=size,
        a2f_bytes_per_token_layer=per_token,
    )
    if split is not None:
        facts.update(
            num_hidden_layers=split["num_layers"],
            remote_layers=list(split["remote_layers"]),
            num_remote_layers=len(split["remote_layers"]),
        )
    elif "num_hidden_layers" in cfg:
        facts["num_hidden_layers"] = cfg["num_hidden_layers"]
    return facts


# --------------------------------------------------------------- the servers
class LogTail:
    """A log sink keeping the last lines (shown if a server fails to start).

    Written by the launcher's log threads, which may outlive the run: after
    :meth:`close` lines are only kept, not forwarded.
    """

    def __init__(
        self, also: IO[str] | None, owned: bool = False, log_dir: Path | None = None
    ) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=60)
        #: each role's full log, ROLE.log (named in a start-up failure)
        self.log_dir = log_dir
        self.also, self.owned = also, owned
        self._lock = threading.Lock()
        #: the attention role's model split, from its start-up line
        self.split: dict[str, Any] | None = None

    def write(self, text: str) -> int:
        self.lines.append(text)
        if self.split is None and "AFD attention model: split" in text:
            parsed = parse_model_line(text)
            if parsed is not None:
                self.split = parsed[1]
        with self._lock:
            if self.also is not None:
                self.also.write(text)
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if self.also is not None:
                self.also.flush()

    def close(self) -> None:
        with self._lock:
            also, self.also = self.also, None
        if also is not None and self.owned:
            also.close()


def _spec(args: argparse.Namespace, vllm_args: list[str]) -> DeploymentSpec:
    return DeploymentSpec.from_args(args, vllm_args)


@contextlib.contextmanager
def afd_target(
    args: argparse.Namespace,
    spec: DeploymentSpec | None,
    pd: PDSpec | None,
    log: LogTail,
) -> Iterator[tuple[str, list[str]]]:
    """(URL the requests go to, URLs with AFD counters) of the deployment,
    started if ``spec``; behind its router if ``pd``."""
    if spec is None:
        url = args.afd_url.rstrip("/")
        yield url, [url, *(u.rstrip("/") for u in args.ffn_url)]
        return
    if pd is not None:
        _note(f"starting PD {pd.prefill_name} + {pd.decode_name} ...")
        with _started_pd(pd, log, "pd-afd", args.ready_timeout) as running:
            decode = running.decode
            yield running.api_url, [decode.api_url, *(p.url for p in decode.ffns)]
        return
    _note(f"starting AFD {spec.attention_ranks}A{spec.ffn_ranks}F ...")
    deployment = Deployment(spec, log=log, log_dir=log.log_dir)
    deployment.start(args.ready_timeout)
    try:
        yield (
            deployment.api_url,
            [deployment.api_url, *(p.url for p in deployment.ffns)],
        )
    finally:
        deployment.stop()


@contextlib.contextmanager
def _started_pd(
    pd: PDSpec, log: LogTail, name: str, ready_timeout: float
) -> Iterator[PDDeployment]:
    log_dir = None if log.log_dir is None else log.log_dir / name
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    running = PDDeployment(pd, log=log, log_dir=log_dir)
    running.start(ready_timeout)
    try:
        yield running
    finally:
        running.stop()


@contextlib.contextmanager
def baseline_target(
    args: argparse.Namespace,
    spec: DeploymentSpec | None,
    pd: PDSpec | None,
    log: LogTail,
) -> Iterator[str | None]:
    if spec is None:
        yield args.baseline_url and args.baseline_url.rstrip("/")
        return
    if pd is not None:
        plain = dataclasses.replace(pd, plain_decode=True)
        _note(f"starting PD {plain.prefill_name} + plain decode (baseline) ...")
        with _started_pd(plain, log, "pd-plain", args.ready_timeout) as running:
            yield running.api_url
        return
    _note("starting plain vLLM (baseline) on the same model and settings ...")
    with PlainServer(spec, log=log, log_dir=log.log_dir) as server:
        yield server.url


@contextlib.contextmanager
def reference_target(
    args: argparse.Namespace,
    spec: DeploymentSpec | None,
    pd: PDSpec | None,
    log: LogTail,
) -> Iterator[str | None]:
    """Plain vLLM without PD (``--prefill``), or ``--reference-url``."""
    if spec is None or pd is None:
        yield args.reference_url and args.reference_url.rstrip("/")
        return
    _note("starting plain vLLM without PD (reference) ...")
    with PlainServer(spec, log=log, log_dir=log.log_dir) as server:
        yield server.url


def _note(text: str) -> None:
    print(f"vllm-afd bench: {text}", file=sys.stderr, flush=True)


def counters(urls: list[str]) -> dict[tuple[str, str, str], float]:
    """The AFD counters of every role server in ``urls``."""
    found: dict[tuple[str, str, str], float] = {}
    for url in urls:
        found.update(afd_metrics(url))
    return found


def settled_counters(
    urls: list[str], timeout: float = 20.0
) -> dict[tuple[str, str, str], float]:
    """Counters once two reads a publish interval (0.5 s) apart agree.

    Raises:
        TimeoutError: they still moved after ``timeout`` s (a figure taken
            from a moving window would be wrong, so none is taken).
    """
    deadline = time.monotonic() + timeout
    last = counters(urls)
    while time.monotonic() < deadline:
        time.sleep(0.6)
        now = counters(urls)
        if now == last:
            return now
        last = now
    raise TimeoutError(
        f"the AFD counters of {urls[0]} were still moving after {timeout:.0f}s "
        "with no request in flight; is another client using the deployment?"
    )


# ---------------------------------------------------------------- the phases
def _prepare(
    args: argparse.Namespace, url: str, lengths: list[tuple[int, int]]
) -> tuple[str, list[Request]]:
    """Served model id and the workload's requests, tokenized by ``url``."""
    served, max_len = model_info(url)
    longest = max(i + o for i, o in lengths)
    if max_len is not None and longest > max_len:
        raise ValueError(
            f"input + output length reaches {longest} tokens but the server's "
            f"max_model_len is {max_len}; lower --input-len/--output-len"
        )
    ins, outs = zip(*lengths, strict=True)
    return served, build_requests(url, served, ins, outs, args.seed)


def _warm_up(url: str, served: str, requests: list[Request], n: int) -> None:
    # Reversed prompts: same lengths, no prefix-cache hits for the workload.
    for req in requests[:n]:
        warm = Request(0, req.prompt[::-1], min(req.output_len, 4))
        timed_request(url, served, warm, stream=True)


def _run(
    args: argparse.Namespace,
    name: str,
    url: str,
    served: str,
    requests: list[Request],
    devices: int,
    stream: bool = True,
) -> RunResult:
    return run_requests(
        name,
        url,
        served,
        requests,
        concurrency=args.concurrency,
        rate=args.request_rate,
        seed=args.seed,
        stream=stream,
        devices=devices,
        progress=not args.no_progress,
    )


def _role_ranks(args: argparse.Namespace, delta: dict) -> tuple[int, int]:
    """(attention, FFN) ranks: those seen in the counters, else -A and -F."""
    seen = {(role, rank) for _, role, rank in delta}
    attention = sum(role == "attention" for role, _ in seen) or args.attention_ranks
    ffn = sum(role == "ffn" for role, _ in seen) or args.ffn_ranks
    return attention, ffn


def _config(
    args: argparse.Namespace, vllm_args: list[str], ranks: tuple[int, int]
) -> dict[str, Any]:
    a, f = ranks
    return {
        "mode": "launch" if args.model and not args.afd_url else "urls",
        "deployment": f"{a}A{f}F",
        "af_ratio": f"{a}:{f}",
        "attention_ranks": a,
        "ffn_ranks": f,
        "connector": args.connector,
        "gate_on_attention": args.gate_on_attention,
        "num_requests": args.num_requests,
        "concurrency": args.concurrency,
        "request_rate": args.request_rate,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "seed": args.seed,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "vllm_args": vllm_args,
        "afd_url": args.afd_url,
        "ffn_urls": args.ffn_url,
        "baseline_url": args.baseline_url,
        "reference_url": args.reference_url,
        "prefill": None,
    }


def measure(args: argparse.Namespace, vllm_args: list[str], log: LogTail) -> dict:
    """Run every phase and return the report."""
    rng = random.Random(args.seed)
    n = args.num_requests
    ins = parse_lengths(args.input_len, "input_len").sample(n, rng)
    outs = parse_lengths(args.output_len, "output_len").sample(n, rng)
    lengths = list(zip(ins, outs, strict=True))
    spec = _spec(args, vllm_args) if args.model and not args.afd_url else None
    pd = _pd_spec(args, spec)

    with afd_target(args, spec, pd, log) as (url, metric_urls):
        served, requests = _prepare(args, url, lengths)
        _warm_up(url, served, requests, args.warmup)
        before = settled_counters(metric_urls)
        afd = _run(args, "AFD", url, served, requests, devices=1)
        delta = report_mod.counter_delta(before, settled_counters(metric_urls))
        # Counters cover the first run; the repeats add figures only.
        more = [
            _run(args, "AFD", url, served, requests, devices=1)
            for _ in range(args.repeats - 1)
        ]
    ranks = _role_ranks(args, delta)
    # role processes: with --prefill the prefill side's count on both PD sides
    prefill = 0 if pd is None else pd.prefill_processes
    afd_runs = [
        dataclasses.replace(r, devices=sum(ranks) + prefill) for r in (afd, *more)
    ]
    afd = afd_runs[0]

    baseline = plain = None
    base_runs: list = []
    with baseline_target(args, spec, pd, log) as base_url:
        if base_url:
            base_served, _ = model_info(base_url)
            _warm_up(base_url, base_served, requests, args.warmup)
            devices = args.baseline_devices if pd is None else prefill + 1
            base_runs = [
                _run(args, "baseline", base_url, base_served, requests, devices)
                for _ in range(args.repeats)
            ]
            baseline = base_runs[0]
            if not args.skip_overhead:
                plain = _run(
                    args,
                    "baseline, no streaming",
                    base_url,
                    base_served,
                    requests,
                    devices,
                    stream=False,
                )
    reference = None
    with reference_target(args, spec, pd, log) as ref_url:
        if ref_url:
            ref_served, _ = model_info(ref_url)
            _warm_up(ref_url, ref_served, requests, args.warmup)
            reference = _run(
                args, "reference", ref_url, ref_served, requests, args.baseline_devices
            )
    if baseline is None:
        _note("no baseline (--baseline-url not given): no side-by-side ratios")
    facts = model_facts(
        args.model, served, vllm_args, args.gate_on_attention, log.split
    )
    config = _config(args, vllm_args, ranks)
    if pd is not None:
        config.update(
            prefill=pd.prefill_name,
            afd_label=f"PD {pd.prefill_name} + {pd.decode_name}",
            baseline_label=f"PD {pd.prefill_name} + plain decode",
            reference_label="plain vLLM",
        )
    elif args.reference_url:
        config["reference_label"] = "reference"
    report = report_mod.build_report(
        config,
        facts,
        afd,
        baseline,
        delta,
        report_mod.overhead_figures(baseline, plain),
        lengths,
        report_mod.repeat_figures(afd_runs, base_runs),
        report_mod.provenance(["vllm-afd", *getattr(args, "argv", [])]),
    )
    if reference is not None:
        report["reference"] = report_mod.reference_figures(afd, reference)
    return report


def _pd_spec(args: argparse.Namespace, spec: DeploymentSpec | None) -> PDSpec | None:
    """The PD deployment ``--prefill`` asks for around ``spec`` (launch mode)."""
    if not args.prefill:
        return None
    if spec is None:
        raise ValueError("--prefill starts PD deployments: give --model, not URLs")
    check_router_installed()
    return PDSpec.make(spec, prefill=args.prefill, port=args.port)


def run_bench(args: argparse.Namespace) -> int:
    vllm_args = list(args.vllm_args)
    if not (args.model or args.afd_url):
        _note("give --model DIR (start AFD and the baseline) or --afd-url URL")
        return 2
    for flag, value in (
        ("--repeats", args.repeats),
        ("--num-requests", args.num_requests),
        ("--concurrency", args.concurrency),
        ("--request-rate", args.request_rate),
    ):
        if value is not None and value <= 0:
            _note(f"{flag}={value} must be positive")
            return 2
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = 8
    log_dir = new_log_dir() if args.model and not args.afd_url else None
    if args.server_log:
        log = LogTail(open(args.server_log, "w"), owned=True, log_dir=log_dir)  # noqa: SIM115
    else:
        log = LogTail(sys.stderr if args.verbose else None, log_dir=log_dir)
    if log_dir is not None:
        _note(f"role logs in {log_dir}")
    try:
        report = measure(args, vllm_args, log)
    except (LaunchError, ValueError, OSError) as exc:
        if not args.verbose and log.lines:
            sys.stderr.write("".join(log.lines))
        _note(f"failed: {exc}")
        return 1
    finally:
        log.close()
    print(bench_format.format_table(report), flush=True)
    if args.json:
        report_mod.write_json(report, args.json)
        _note(f"wrote {args.json}")
    if args.plot_dir:
        path = plots.plot_report(report, args.plot_dir)
        _note(f"wrote {path}" if path else "matplotlib not installed: no plots")
    failed = report["afd"]["failed"] + ((report["baseline"] or {}).get("failed") or 0)
    if report.get("reference"):
        failed += report["reference"]["figures"]["failed"]
    return 1 if failed else 0
