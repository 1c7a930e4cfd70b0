"""``vllm-afd plan``: which A:F ratio pays for this model on this machine.

::

    vllm-afd plan MODEL [--context-lens 128,512] [--batch-sizes 1,4,16]
                  [--tpot-slo-ms MS] [--devices N] [--tp-baselines 2]
                  [--check] [-- vllm args…]

Measures the decode parts on real servers (``cli.plan_profile``; cached per
model, arguments and machine), predicts every xAyF and micro-batch count
that fits ``--devices`` (``cli.plan_model``), recommends one and, with
``--check``, launches the recommended deployment and others and prints the
predicted and measured step side by side. See docs/planning.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_afd.cli import bench_report, plots
from vllm_afd.cli.bench_workload import model_info
from vllm_afd.cli.plan_fit import Point
from vllm_afd.cli.plan_format import (
    format_check,
    format_plan,
    format_profile,
    format_scaled,
)
from vllm_afd.cli.plan_model import (
    MAX_SHARED_RANKS,
    SHARED_PLATFORMS,
    Candidate,
    Link,
    Plan,
    Profile,
    best_batch,
    make_plan,
    on_separate_devices,
)
from vllm_afd.cli.plan_profile import (
    LogWatch,
    decode_step,
    profile,
    warm_up,
)
from vllm_afd.config import DEFAULT_PORT
from vllm_afd.deploy import Deployment, DeploymentSpec, LaunchError
from vllm_afd.deploy.logs import new_log_dir
from vllm_afd.deploy.spec import tensor_parallel_size, vllm_arg
from vllm_afd.errors import AFDConfigError
from vllm_afd.topology import Topology

#: bumped when what the cache holds changes meaning
CACHE_VERSION = 4
#: --target-devices' default link: half the cuda_ipc round trip measured in
#: CUDA graphs on one H100/H200 (8.9-10.8 us at 1-256 tokens of hidden 2048),
#: and a bandwidth below NVLink's per direction
LINK_LATENCY_US = 5.0
LINK_GB_S = 100.0
#: vLLM's own routing simulation (``VLLM_MOE_ROUTING_SIMULATION_STRATEGY``):
#: every router picks top-k experts uniformly at random, so the experts are
#: loaded evenly whatever the weights and prompts
ROUTING_ENV = "VLLM_MOE_ROUTING_SIMULATION_STRATEGY"
BALANCED = "uniform_random"


def _ints(flag: str):
    def parse(value: str) -> list[int]:
        try:
            out = sorted({int(v) for v in value.split(",") if v.strip()})
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag} takes comma-separated integers, got {value!r}"
            ) from None
        if not out or out[0] < 1:
            raise argparse.ArgumentTypeError(f"{flag} values must be >= 1: {value!r}")
        return out

    return parse


def _topologies(value: str) -> list[Candidate]:
    out = []
    for item in value.split(","):
        name, _, m = item.strip().partition(":")
        a, sep, f = name.upper().rstrip("F").partition("A")
        if not sep or not a.isdigit() or not f.isdigit() or (m and not m.isdigit()):
            raise argparse.ArgumentTypeError(
                f"--check-topologies takes e.g. 1A1F,2A1F,2A2F:2 (':m' micro-"
                f"batches), got {item!r}"
            )
        try:
            Topology(int(a), int(f))
        except AFDConfigError as e:
            raise argparse.ArgumentTypeError(
                f"--check-topologies {item}: {e}"
            ) from None
        out.append(Candidate(int(a), int(f), int(m or 1)))
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="measure both roles, predict every A:F ratio, recommend one",
        description="Profile the model's attention and FFN parts on this machine, "
        "predict decode throughput per device for every A:F ratio and micro-batch "
        "count against colocated vLLM, and recommend one. Arguments after `--` "
        "go to every `vllm serve` it starts.",
    )
    p.add_argument("model", help="model directory")
    p.add_argument("--context-lens", type=_ints("--context-lens"), default=[128, 512])
    p.add_argument(
        "--batch-sizes", type=_ints("--batch-sizes"), default=[1, 4, 16],
        help="sequences per attention rank to measure and choose from",
    )  # fmt: skip
    p.add_argument("--decode-tokens", type=int, default=32, help="per measured request")
    p.add_argument("--tpot-slo-ms", type=float, default=None, help="step time bound")
    p.add_argument(
        "--devices", type=int, default=None,
        help="devices to spend (GPUs; on CPU role processes of this host); default: "
        "the visible GPUs, on CPU 4",
    )  # fmt: skip
    p.add_argument("--max-ubatches", type=int, default=2, help="micro-batch counts")
    p.add_argument(
        "--target-devices", type=int, default=None,
        help="also predict every xAyF on N separate devices from the parts "
        "measured here, the round trip charged by the link below (a prediction "
        "for hardware not measured, printed as such)",
    )  # fmt: skip
    p.add_argument(
        "--link-latency-us", type=float, default=LINK_LATENCY_US,
        help="--target-devices: one-way latency of a message between an "
        "attention and an FFN device",
    )  # fmt: skip
    p.add_argument(
        "--link-gb-s", type=float, default=LINK_GB_S,
        help="--target-devices: bandwidth between an attention and an FFN "
        "device, GB/s",
    )  # fmt: skip
    p.add_argument(
        "--tp-baselines", type=_ints("--tp-baselines"), default=[],
        help="also measure plain vLLM with these tensor-parallel sizes (each "
        ">= 2, over that many devices) as colocated baselines; the best one "
        "that fits --devices is the reference",
    )  # fmt: skip
    p.add_argument(
        "--routing", choices=("model", "balanced"), default="model",
        help="model: the experts the model's router picks for the measured "
        "prompts; balanced: every server routes uniformly at random (vLLM's "
        f"{ROUTING_ENV}={BALANCED}), the experts loaded evenly",
    )  # fmt: skip
    p.add_argument("--gate-on-attention", action="store_true")
    p.add_argument("--connector-extra-config", type=json.loads, default={})
    p.add_argument("--json", help="write the profile, plan and check as JSON here")
    p.add_argument("--plot", help="write a PNG of tokens/s per device against A:F")
    p.add_argument("--cache-dir", default=None, help="default ~/.cache/vllm-afd/plan")
    p.add_argument("--no-cache", action="store_true", help="measure again")
    p.add_argument("--check", action="store_true", help="launch and measure")
    p.add_argument(
        "--check-topologies", type=_topologies, default=None,
        help="what --check launches (default: the recommended and the next two)",
    )  # fmt: skip
    p.add_argument("--port", type=int, default=8000, help="API port of the servers")
    p.add_argument("--ffn-port", type=int, default=None)
    p.add_argument("--afd-port", type=int, default=DEFAULT_PORT)
    p.add_argument(
        "--repeats", type=int, default=1,
        help="measure every point (and every check) N times; medians",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--server-log", help="write the servers' logs to this file")
    p.set_defaults(vllm_args=[], func=run_plan)


def _note(text: str) -> None:
    print(f"vllm-afd plan: {text}", file=sys.stderr, flush=True)


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def _spec(args: argparse.Namespace, gpus: int) -> DeploymentSpec:
    spec = DeploymentSpec(
        model=args.model,
        port=args.port,
        ffn_port=args.ffn_port,
        afd_port=args.afd_port,
        gate_on_attention=args.gate_on_attention,
        connector_extra_config=args.connector_extra_config,
        vllm_args=list(args.vllm_args),
        ready_timeout_s=args.ready_timeout,
    )
    return _placed(spec, Candidate(1, 1), gpus)


def _placed(spec: DeploymentSpec, cand: Candidate, gpus: int) -> DeploymentSpec:
    """``spec`` as ``cand``; on GPUs attention ranks first, then FFN ranks
    (one GPU: both roles on GPU 0)."""
    spec = dataclasses.replace(
        spec,
        attention_ranks=cand.attention_ranks,
        ffn_ranks=cand.ffn_ranks,
        ubatches=cand.ubatches,
    )
    if gpus == 0:
        return spec
    x, y = cand.attention_ranks, cand.ffn_ranks
    if gpus == 1:
        return dataclasses.replace(spec, attention_devices="0", ffn_devices="0")
    ids = [str(i) for i in range(x + y)]
    return dataclasses.replace(
        spec, attention_devices=",".join(ids[:x]), ffn_devices=",".join(ids[x:])
    )


def cache_key(
    args: argparse.Namespace, platform: str, where: dict[str, Any],
    phases: Sequence[str] = (),
) -> str:  # fmt: skip
    """What the measurement depends on, hashed (``where``: the run's
    ``bench_report.provenance``, for the device and the versions; ``phases``:
    :func:`measured_phases`)."""
    config = Path(args.model) / "config.json"
    facts = {
        "v": CACHE_VERSION,
        "model": str(Path(args.model).resolve()),
        "config": config.read_text() if config.is_file() else None,
        "vllm_args": args.vllm_args,
        "gate": args.gate_on_attention,
        "extra": args.connector_extra_config,
        "contexts": args.context_lens,
        "batches": args.batch_sizes,
        "decode": args.decode_tokens,
        "repeats": args.repeats,
        "tp_baselines": args.tp_baselines,
        "routing": routing_strategy(args),
        "platform": platform,
        "phases": list(phases),
        **{k: where.get(k) for k in ("device", "vllm", "vllm_afd", "torch")},
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def sharing_ranks(platform: str, devices: int) -> list[int]:
    """The attention-rank counts k whose kA1F the profile measures for S_k:
    on one device, 2 to the most the budget holds beside one FFN rank, at
    most ``MAX_SHARED_RANKS``; none elsewhere."""
    if platform not in SHARED_PLATFORMS:
        return []
    return list(range(2, min(devices - 1, MAX_SHARED_RANKS) + 1))


def measured_phases(args: argparse.Namespace, platform: str, devices: int) -> list[str]:
    """The profile's optional phases this run needs: ``sharedK`` (kA1F, for
    S_k: one device, for each k from 2 to the most attention ranks the budget
    holds beside one FFN rank, at most ``MAX_SHARED_RANKS``), ``ubatched``
    (1A1F with 2 micro-batches, for U: one GPU, and micro-batches to predict
    or check)."""
    phases = [f"shared{k}" for k in sharing_ranks(platform, devices)]
    checked = max((c.ubatches for c in args.check_topologies or []), default=1)
    if platform == "cuda-shared" and max(args.max_ubatches, checked) >= 2:
        phases.append("ubatched")
    return phases


def routing_strategy(args: argparse.Namespace) -> str:
    """What every server this run starts routes by: ``--routing balanced``
    sets vLLM's routing simulation; otherwise whatever the environment says
    (empty: the model's router)."""
    if args.routing == "balanced":
        return BALANCED
    return os.environ.get(ROUTING_ENV, "").lower()


def _cache_path(args: argparse.Namespace, key: str) -> Path:
    base = args.cache_dir or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
        "vllm-afd",
        "plan",
    )
    return Path(base) / f"{key}.json"


def _points_json(points: list[Point]) -> list[dict]:
    return [dataclasses.asdict(p) for p in points]


# ------------------------------------------------------------------- check
def check(
    args: argparse.Namespace,
    base_spec: DeploymentSpec,
    prof: Profile,
    plan: Plan,
    gpus: int,
    log: LogWatch,
) -> list[dict[str, Any]]:
    """Launch each checked deployment; predicted and measured side by side.

    A deployment that fails to start or to serve (a role exits, requests
    fail, a hang ends in the connector's timeout) gets a row with
    ``failed`` (the reason) and no measurement; the others are still
    checked."""
    context = plan.recommended.context if plan.recommended else args.context_lens[0]
    chosen = args.check_topologies or _next_best(plan, context)
    rows = []
    for cand in chosen:
        pred = best_batch(prof, cand, context, args.batch_sizes, _slo(args)).best
        if pred is None:
            _note(f"--check: {cand.name} fits nothing at context {context}; skipped")
            continue
        _note(f"--check: starting {cand.name} (batch {pred.batch} per rank) ...")
        spec = _placed(base_spec, cand, gpus)
        row: dict[str, Any] = {
            "deployment": cand.name,
            "context": context,
            "batch": pred.batch,
            "predicted_step_ms": pred.step_s * 1e3,
            "predicted_tokens_per_s_per_device": pred.tokens_per_s_per_device,
        }
        rows.append(row)
        dep = Deployment(spec, log=log, log_dir=log.log_dir)
        try:
            dep.start(args.ready_timeout)
            step = _measured_step(dep.api_url, cand, context, pred.batch, args)
        except (LaunchError, RuntimeError, OSError) as exc:
            row["failed"] = str(exc)
            _note(f"--check: {cand.name} failed ({exc}); checking the others")
            continue
        finally:
            dep.stop()
        devices = 1 if prof.shared_cores else cand.devices
        row["measured_step_ms"] = step * 1e3
        row["step_error"] = (pred.step_s - step) / step
        row["measured_tokens_per_s_per_device"] = (
            cand.attention_ranks * pred.batch / step / devices
        )
    return rows


def _next_best(plan: Plan, context: int) -> list[Candidate]:
    rows = sorted(
        (p for p in plan.rows if p.context == context),
        key=lambda p: -p.tokens_per_s_per_device,
    )
    return [p.candidate for p in rows[:3] if p.candidate is not None]


def _measured_step(
    url: str, cand: Candidate, context: int, batch: int, args: argparse.Namespace
) -> float:
    served, _ = model_info(url)
    warm_up(url, served, context, 2 * cand.attention_ranks)  # every rank warms up
    n = cand.attention_ranks * batch
    steps = [
        decode_step(url, served, n, context, args.decode_tokens,
                    args.seed + 1 + 10 * k, f"--check {cand.name}", note=_note)
        for k in range(args.repeats)
    ]  # fmt: skip
    return statistics.median(steps)


def model_link(args: argparse.Namespace) -> Link:
    """The scale model's link for the model of ``args``: per token and remote
    layer, the hidden state each way (twice, with shared experts: the FFN
    ships the routed and shared outputs apart) and, with the gate on
    attention, the top-k ids and weights (4 bytes each)."""
    config = json.loads((Path(args.model) / "config.json").read_text())
    config = config.get("text_config", config)
    hidden = int(config["hidden_size"])
    dtype = vllm_arg(args.vllm_args, "--dtype") or "auto"
    if dtype == "auto":
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    act = bench_report.DTYPE_BYTES.get(dtype.removeprefix("torch."), 2)
    shared = any(
        config.get(k) for k in ("n_shared_experts", "shared_expert_intermediate_size")
    )
    per_token = hidden * act * (1 + (2 if shared else 1))
    if args.gate_on_attention:
        per_token += 8 * int(config.get("num_experts_per_tok") or 0)
    return Link(args.link_latency_us * 1e-6, args.link_gb_s * 1e9, per_token)


def _slo(args: argparse.Namespace) -> float | None:
    return args.tpot_slo_ms / 1e3 if args.tpot_slo_ms else None


# -------------------------------------------------------------------- main
def _validate(args: argparse.Namespace) -> str | None:
    if not (Path(args.model) / "config.json").is_file():
        return f"{args.model} has no config.json: give a model directory"
    if args.decode_tokens < 3:
        return f"--decode-tokens={args.decode_tokens} must be >= 3"
    if args.devices is not None and args.devices < 2:
        return f"--devices={args.devices} must be >= 2 (one rank per role)"
    if args.repeats < 1:
        return f"--repeats={args.repeats} must be >= 1"
    if args.max_ubatches < 1:
        return f"--max-ubatches={args.max_ubatches} must be >= 1"
    if args.tpot_slo_ms is not None and args.tpot_slo_ms <= 0:
        return f"--tpot-slo-ms={args.tpot_slo_ms} must be positive"
    if args.target_devices is not None and args.target_devices < 2:
        return f"--target-devices={args.target_devices} must be >= 2 (one per role)"
    if args.link_latency_us < 0 or args.link_gb_s <= 0:
        return (
            f"--link-latency-us={args.link_latency_us} must be >= 0 and "
            f"--link-gb-s={args.link_gb_s} positive"
        )
    if args.tp_baselines and args.tp_baselines[0] < 2:
        return (
            f"--tp-baselines={','.join(map(str, args.tp_baselines))}: sizes must "
            "be >= 2 (tensor parallelism 1 is the colocated baseline already)"
        )
    if args.tp_baselines and tensor_parallel_size(args.vllm_args) > 1:
        return (
            "--tp-baselines with --tensor-parallel-size in the vLLM arguments: "
            "those go to every role; give the tensor-parallel sizes to compare "
            "with --tp-baselines only"
        )
    return None


def run_plan(args: argparse.Namespace) -> int:
    problem = _validate(args)
    if problem:
        _note(problem)
        return 2
    gpus = _gpus()
    # one GPU: every role on it, like one host's cores
    platform = "cpu" if gpus == 0 else "cuda-shared" if gpus == 1 else "cuda"
    if platform == "cpu" and args.max_ubatches > 1:
        args.max_ubatches = 1  # vLLM's CPU runner has no micro-batches
    devices = args.devices or (gpus if gpus >= 2 else 4)
    if gpus == 1 and args.devices is None:
        devices = 2  # both roles share GPU 0 (cuda_ipc, MPS)
    if gpus >= 2 and devices > gpus:
        _note(f"--devices={devices} but {gpus} GPUs are visible; give at most {gpus}")
        return 2
    for n in args.tp_baselines:
        cores = len(os.sched_getaffinity(0))
        if not gpus and n > cores:
            _note(f"--tp-baselines {n} needs {n} CPU cores, {cores} are usable")
            return 2
        if gpus and n > gpus:
            _note(f"--tp-baselines {n} needs {n} GPUs, {gpus} are visible")
            return 2
        if n > devices:
            _note(f"--tp-baselines {n} needs {n} devices, --devices is {devices}")
            return 2
    for cand in args.check_topologies or []:
        if platform == "cpu" and cand.ubatches > 1:
            _note(f"--check-topologies {cand.name}: micro-batches need CUDA "
                  "(vLLM's CPU runner has none); drop ':m'")  # fmt: skip
            return 2
        if gpus >= 2 and cand.devices > gpus:
            _note(f"--check-topologies {cand.name} needs {cand.devices} GPUs, "
                  f"{gpus} are visible")  # fmt: skip
            return 2
    routing = routing_strategy(args)
    if args.routing == "balanced":
        os.environ[ROUTING_ENV] = BALANCED  # every server started from here
    elif routing:
        _note(f"{ROUTING_ENV}={routing} is set: every server routes by it")
    where = bench_report.provenance(["vllm-afd", *getattr(args, "argv", [])])
    phases = measured_phases(args, platform, devices)
    key = cache_key(args, platform, where, phases)
    path = _cache_path(args, key)
    sink = open(args.server_log, "w") if args.server_log else None  # noqa: SIM115
    log = LogWatch(sink, owned=True, log_dir=new_log_dir())
    _note(f"role logs in {log.log_dir}")
    spec = _spec(args, gpus)
    try:
        if path.is_file() and not args.no_cache:
            cached = json.loads(path.read_text())
            prof = Profile.from_json(cached["profile"])
            points = cached["points"]
            where = cached.get("provenance", where)
            _note(f"using the cached profile {path} (--no-cache measures again)")
        else:
            prof, measured = profile(
                spec, args.context_lens, args.batch_sizes, args.decode_tokens,
                platform, seed=args.seed, repeats=args.repeats,
                tp_baselines=args.tp_baselines, log=log, note=_note,
                sharing_ranks=sharing_ranks(platform, devices),
                measure_ubatching="ubatched" in phases,
            )  # fmt: skip
            points = {k: _points_json(v) for k, v in measured.items()}
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({
                "profile": prof.to_json(), "points": points, "provenance": where,
            }, indent=1))  # fmt: skip
        plan = make_plan(prof, devices, args.context_lens, args.batch_sizes,
                         _slo(args), args.max_ubatches)  # fmt: skip
        unit = prof.unit
        print(f"routing: {routing or 'the model router'}")
        print(format_profile(prof, points["afd"], points.get("plain")))
        print(format_plan(plan, unit), flush=True)
        scaled = None
        if args.target_devices:
            link = model_link(args)
            scaled = make_plan(
                on_separate_devices(prof, link, max(args.batch_sizes)),
                args.target_devices, args.context_lens, args.batch_sizes,
                _slo(args), args.max_ubatches,
            )  # fmt: skip
            print(format_scaled(scaled, args.target_devices, link), flush=True)
        checked = check(args, spec, prof, plan, gpus, log) if args.check else []
        if checked:
            print(format_check(checked, unit, plan))
    except (LaunchError, ValueError, OSError, RuntimeError) as exc:
        if log.lines and not args.server_log:
            sys.stderr.write("".join(log.lines))
        _note(f"failed: {exc}")
        return 1
    finally:
        log.close()
    print("profile " + bench_report.provenance_line(where))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "profile": prof.to_json(), "points": points,
            "plan": plan.to_json(), "check": checked, "devices": devices,
            "target_devices": scaled.to_json() if scaled else None,
            "routing": routing or "model",
            "provenance": where,
        }, indent=1))  # fmt: skip
        _note(f"wrote {args.json}")
    if args.plot:
        title = f"{Path(args.model).name} on {where['device']}, {devices} devices"
        ok = plots.plot_plan(plan, args.plot, unit, title)
        _note(f"wrote {args.plot}" if ok else "matplotlib not installed: no plot")
    failed = [r["deployment"] for r in checked if "failed" in r]
    if failed:
        _note(f"--check could not measure {', '.join(failed)} (above); exit 1")
        return 1
    return 0
