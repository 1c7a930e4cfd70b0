"""``vllm-afd launch``: start, watch and stop every role process of a deployment.

One ``vllm serve`` for the attention role (``--data-parallel-size M`` when
M > 1), which answers the OpenAI API, and one per FFN rank (``afd.rank``),
each on its own port, answering no completions. The launcher
waits until both report healthy, prints the API URL, streams each process's
log with a prefix, and stops everything on Ctrl-C, SIGTERM, or when an
attention process exits (naming it). An FFN rank that exits or hangs is
restarted with a backoff (``--ffn-restarts``, ``--ffn-health-timeout``);
the attention ranks rejoin it and serve on.

With ``--prefill N`` the deployment is the decode side of a prefill/decode
deployment (:mod:`vllm_afd.deploy.pd`): N plain prefill servers, the KV
connector of ``--kv-transfer-config`` between them and the attention role,
and vLLM's router on ``--port``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import threading
from pathlib import Path

from vllm_afd.config import DEFAULT_PORT
from vllm_afd.deploy import Deployment, DeploymentSpec, dry_run, placement, ready_line
from vllm_afd.deploy.commands import CPU_BIND_CHOICES
from vllm_afd.deploy.logs import ConsoleFilter, TextSink, new_log_dir
from vllm_afd.deploy.pd import (
    AFDPrefill,
    PDDeployment,
    PDSpec,
    check_router_installed,
    parse_prefill,
    pd_dry_run,
    pd_ready_line,
)
from vllm_afd.deploy.placement import PlacementError
from vllm_afd.deploy.process import DeploymentEnded, LaunchError


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each flag's default, unless it has none or says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, [], {}, False) or "default" in text:
            return text
        return super()._get_help_string(action) or text


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="start and supervise an AFD deployment",
        description="Start every role process, wait until ready, print the API "
        "URL; restart an FFN rank that exits or hangs (the attention ranks "
        "rejoin it); stop all on Ctrl-C, SIGTERM, or when an attention process "
        "dies. Arguments after `--` go to every `vllm serve`.",
        formatter_class=DefaultsHelp,
    )
    p.add_argument("model", help="model directory or name, as for vllm serve")
    add_topology_flags(p)
    p.add_argument(
        "--api-host",
        default=None,
        help="address every role's API server binds (vllm serve --host; "
        "0.0.0.0 for all interfaces) (default: 127.0.0.1; across hosts this "
        "node's address in --hosts)",
    )
    p.add_argument(
        "--port",
        type=int,
        default=8000,
        help="API port: the attention role's (with --prefill: the router's)",
    )
    p.add_argument(
        "--ffn-port",
        type=int,
        default=None,
        help="API port of FFN rank 0, rank k on --ffn-port + k (default: --port + 1)",
    )
    p.add_argument(
        "--afd-port",
        type=int,
        default=DEFAULT_PORT,
        help="connector rendezvous port (afd.port; the data-plane store "
        "takes afd.port + 1)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="connector address (afd.host): FFN rank 0 binds the rendezvous "
        "and the data-plane store there",
    )
    p.add_argument("--connector", default="p2p", help="connector (afd.connector)")
    p.add_argument(
        "--ubatches",
        type=int,
        default=1,
        help="afd.num_ubatches of the attention role (2: dual-batch overlap; "
        "p2p on CUDA, async on CPU)",
    )
    p.add_argument(
        "--attention-args",
        type=shlex.split,
        default=[],
        help="extra vllm serve arguments for the attention role only",
    )
    p.add_argument(
        "--ffn-args",
        type=shlex.split,
        default=[],
        help="extra vllm serve arguments for every FFN rank only",
    )
    add_device_flags(p)
    add_host_flags(p)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print every node's processes (environment and vllm-afd serve "
        "command) and exit",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for every role to answer /health (also for a "
        "restarted FFN rank)",
    )
    p.add_argument(
        "--ffn-restarts",
        type=_non_negative_int,
        default=10,
        help="restart an FFN rank that exits or hangs, with a backoff of 1, 2, "
        "4 ... 30 s, at most this many times in a row (0: off; the deployment "
        "stops when an FFN rank exits)",
    )
    p.add_argument(
        "--ffn-health-timeout",
        type=float,
        default=30.0,
        help="seconds an FFN rank may leave /health unanswered before it counts "
        "as hung and is killed (and restarted)",
    )
    add_pd_flags(p)
    add_log_flags(p)
    p.set_defaults(vllm_args=[])  # main() puts everything after `--` here
    p.set_defaults(func=run_launch)


def add_pd_flags(p: argparse.ArgumentParser) -> None:
    """AFD as the decode side of a prefill/decode deployment."""
    g = p.add_argument_group(
        "prefill/decode disaggregation",
        "With --prefill N the deployment is the decode side: N plain prefill "
        "servers (or, with --prefill xAyF[:async], one AFD prefill deployment) "
        "hand their KV cache to the attention role through vLLM's KV "
        "connector (--kv-transfer-config among the vLLM arguments; default "
        "ExampleConnector through files in the log directory), and vLLM's "
        "router answers on --port (docs/deployment.md).",
    )
    g.add_argument(
        "--prefill",
        type=parse_prefill_flag,
        default=0,
        metavar="N|xAyF[:async]",
        help="plain vLLM prefill servers in front of the AFD decode deployment "
        "(0: none, the attention role answers on --port), or one AFD prefill "
        "deployment of x attention and y FFN ranks (':async': the async "
        "connector, experts split over the FFN ranks)",
    )
    g.add_argument(
        "--plain-decode",
        action="store_true",
        help="with --prefill: one plain vLLM decode server (the KV consumer, on "
        "the decode port) instead of the AFD decode deployment: PD without AFD, "
        "to compare with (vllm-afd bench --prefill starts it itself)",
    )
    g.add_argument(
        "--decode-port",
        type=int,
        default=None,
        help="with --prefill: the decode attention API port (default: --port + 1; "
        "the FFN ranks follow it)",
    )
    g.add_argument(
        "--prefill-port",
        type=int,
        default=None,
        help="with --prefill: API port of prefill server 0, server k on "
        "--prefill-port + k; of an AFD prefill deployment's attention role, its "
        "FFN ranks after it (default: after the FFN ports)",
    )
    g.add_argument(
        "--prefill-args",
        type=shlex.split,
        default=[],
        help="extra vllm serve arguments for the prefill servers only (every "
        "role of an AFD prefill deployment)",
    )
    g.add_argument(
        "--prefill-devices",
        metavar="LIST",
        help="CUDA_VISIBLE_DEVICES of the prefill servers (of each role of an "
        "AFD prefill deployment, split evenly)",
    )
    g.add_argument(
        "--prefill-restarts",
        type=_non_negative_int,
        default=10,
        help="restart a prefill server that exits (an AFD prefill deployment "
        "that ends, whole), with a backoff of 1, 2, 4 ... 30 s, at most this "
        "many times in a row",
    )


def add_log_flags(p: argparse.ArgumentParser) -> None:
    """``--verbose`` / ``--log-dir``: where the roles' output goes."""
    p.add_argument(
        "--verbose",
        action="store_true",
        help="print every line of every role's log, prefixed [role] (default: "
        "errors, AFD warnings and progress only; the full logs go to --log-dir)",
    )
    p.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="directory for each role's full log, ROLE.log (default: a new "
        "directory under the system's temporary directory, printed at start)",
    )


def console_and_logs(args: argparse.Namespace, who: str) -> tuple[TextSink, Path]:
    """The console sink of the roles' output and their log directory (made
    and printed here) for ``args``' ``--verbose`` and ``--log-dir``."""
    log_dir = args.log_dir or new_log_dir()
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"vllm-afd {who}: role logs in {log_dir}", file=sys.stderr, flush=True)
    console: TextSink = sys.stdout if args.verbose else ConsoleFilter(sys.stdout)
    return console, log_dir


def _non_negative_int(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{value} is not >= 0")
    return n


def add_host_flags(p: argparse.ArgumentParser) -> None:
    """The place of this launcher in a deployment across hosts."""
    p.add_argument(
        "--hosts",
        metavar="LIST",
        help="address of every node of a deployment across hosts, node rank = "
        "position, e.g. 10.0.0.1,10.0.0.2 (run the same command on each)",
    )
    p.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="this node's rank in --hosts (default: LWS_WORKER_INDEX or "
        "SLURM_NODEID from the environment)",
    )
    p.add_argument(
        "--attention-nodes",
        metavar="LIST",
        help="node rank of each attention rank, consecutive per node, e.g. "
        "0,1 (default: all on node 0)",
    )
    p.add_argument(
        "--ffn-nodes",
        metavar="LIST",
        help="node rank of each FFN rank, e.g. 2,1 (default: the nodes after "
        "0 in turn)",
    )
    p.add_argument(
        "--dp-rpc-port",
        type=int,
        default=None,
        help="vLLM --data-parallel-rpc-port when attention spans nodes "
        "(default: --afd-port + 2)",
    )


def add_topology_flags(p: argparse.ArgumentParser) -> None:
    """Ranks, gate placement and connector options (launch and bench)."""
    p.add_argument(
        "-A",
        "--attention-ranks",
        type=int,
        default=1,
        help="attention ranks (data-parallel ranks of the attention server)",
    )
    p.add_argument(
        "-F", "--ffn-ranks", type=int, default=1, help="FFN ranks (a server each)"
    )
    p.add_argument(
        "--gate-on-attention",
        action="store_true",
        help="run the MoE gate and top-k on the attention role "
        "(afd.compute_gate_on_attention)",
    )
    p.add_argument(
        "--connector-extra-config",
        type=json.loads,
        default={},
        help="JSON object for afd.connector_extra_config, e.g. '{\"timeout_s\": 30}'",
    )


def add_device_flags(p: argparse.ArgumentParser) -> None:
    """``--attention-devices`` / ``--ffn-devices`` (launch and bench)."""
    p.add_argument(
        "--attention-devices",
        metavar="LIST",
        help="CUDA_VISIBLE_DEVICES of the attention server, e.g. 0; fewer GPUs "
        "than attention ranks share each GPU among consecutive ranks",
    )
    p.add_argument(
        "--ffn-devices",
        metavar="LIST",
        help="CUDA_VISIBLE_DEVICES of the FFN ranks, split evenly, rank k the "
        "k-th group, e.g. 1 (one rank) or 2,3 (two ranks)",
    )
    add_cpu_bind_flag(p)


def add_cpu_bind_flag(p: argparse.ArgumentParser) -> None:
    """``--cpu-bind`` (launch, bench and bench-ttft)."""
    p.add_argument(
        "--cpu-bind",
        choices=CPU_BIND_CHOICES,
        default="vllm",
        help="CPU deployments: vllm lets each role process bind its threads "
        "itself (vLLM's automatic binding puts every role on the same cores); "
        "split gives each role process an equal share of the launcher's cores, "
        "an attention server one share per attention rank",
    )


def run_launch(args: argparse.Namespace) -> int:
    try:
        hosts = args.hosts.split(",") if args.hosts else ["127.0.0.1"]
        if args.dry_run and args.node_rank is None:
            args.resolved_node_rank = 0
        else:
            args.resolved_node_rank = placement.node_rank_from(
                args.node_rank, os.environ, len(hosts)
            )
        spec = DeploymentSpec.from_args(args, list(args.vllm_args))
        if args.plain_decode and not args.prefill:
            raise LaunchError("--plain-decode is the decode side of PD: give --prefill")
        if args.prefill and spec.cpu_bind != "vllm":
            raise LaunchError(
                "--cpu-bind split shares the cores among one deployment's roles; "
                "with --prefill two deployments would split the same cores"
            )
        pd = _pd_spec(spec, args) if args.prefill else None
        if args.dry_run:
            text = (
                dry_run(spec, only=args.node_rank)
                if pd is None
                else pd_dry_run(pd, (args.log_dir or Path("LOG_DIR")) / "kv")
            )
            print(text, flush=True)
            return 0
        if pd is not None:
            check_router_installed()
        console, log_dir = console_and_logs(args, "launch")
        deployment: Deployment | PDDeployment = (
            Deployment(spec, log=console, log_dir=log_dir)
            if pd is None
            else PDDeployment(pd, log=console, log_dir=log_dir)
        )
        if deployment.budget.note:
            print(f"vllm-afd launch: {deployment.budget.note}", file=sys.stderr)
    except (LaunchError, PlacementError) as exc:
        print(f"vllm-afd launch: {exc}", file=sys.stderr, flush=True)
        return 2
    stop = threading.Event()
    started = threading.Event()

    def on_sigterm(*_: object) -> None:
        if not started.is_set():  # leave the start-up wait at once
            raise _Stopped
        stop.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        deployment.start(args.ready_timeout)
        started.set()
        line = (
            pd_ready_line(deployment)
            if isinstance(deployment, PDDeployment)
            else ready_line(deployment)
        )
        print(line, flush=True)
        while not stop.is_set():
            deployment.supervise()
            stop.wait(1.0)
    except (KeyboardInterrupt, _Stopped):
        pass
    except DeploymentEnded as exc:
        print(f"vllm-afd launch: {exc}", file=sys.stderr, flush=True)
    except LaunchError as exc:
        print(f"vllm-afd launch: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        deployment.stop()
    return 0


def parse_prefill_flag(value: str) -> int | AFDPrefill:
    """``--prefill N|xAyF[:async]`` as argparse reads it."""
    try:
        return parse_prefill(value)
    except LaunchError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _pd_spec(spec: DeploymentSpec, args: argparse.Namespace) -> PDSpec:
    if args.plain_decode and (spec.attention_ranks, spec.ffn_ranks) != (1, 1):
        raise LaunchError(
            "--plain-decode runs one plain vLLM decode server; -A/-F describe "
            "an AFD decode deployment: leave them out"
        )
    return PDSpec.make(
        spec,
        prefill=args.prefill,
        port=args.port,
        decode_port=args.decode_port,
        prefill_port=args.prefill_port,
        prefill_args=args.prefill_args,
        prefill_devices=args.prefill_devices,
        prefill_restarts=args.prefill_restarts,
        plain_decode=args.plain_decode,
    )


class _Stopped(Exception):
    """SIGTERM arrived while the deployment was starting."""
