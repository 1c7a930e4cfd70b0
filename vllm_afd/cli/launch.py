"""``vllm-afd launch``: start, watch and stop every role process of a deployment.

One ``vllm serve`` for the attention role (``--data-parallel-size M`` when
M > 1), which answers the OpenAI API, and one per FFN rank (``afd.rank``),
each on its own port, answering no completions. The launcher
waits until both report healthy, prints the API URL, streams each process's
log with a prefix, and stops everything on Ctrl-C, SIGTERM, or when any
process exits (non-zero, naming it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

from vllm_afd.config import DEFAULT_PORT

#: CPU work-around for vLLM 0.32.0's rotary kernel on DeepSeek (see docs).
CPU_COMPILATION_CONFIG = '{"custom_ops":["all","-rotary_embedding"]}'


class LaunchError(RuntimeError):
    """A role process failed to start or died."""


@dataclass
class RoleProcess:
    """One supervised ``vllm serve`` process."""

    name: str
    argv: list[str]
    port: int
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    _pump: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log: IO[str] | None) -> None:
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._pump = threading.Thread(
            target=_pump_lines,
            args=(self.proc.stdout, f"[{self.name}] ", log),
            daemon=True,
        )
        self._pump.start()

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        _signal_group(self.proc, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _signal_group(self.proc, signal.SIGKILL)
            self.proc.wait(10)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _pump_lines(stream: IO[bytes], prefix: str, log: IO[str] | None) -> None:
    for raw in iter(stream.readline, b""):
        if log is not None:
            log.write(prefix + raw.decode(errors="replace"))
            log.flush()


@dataclass
class DeploymentSpec:
    """What to launch.

    ``vllm_args`` go to every role process (and to the plain baseline);
    ``attention_args`` / ``ffn_args`` only to that role (e.g. its
    ``--tensor-parallel-size``). ``attention_devices`` / ``ffn_devices`` are
    comma-separated GPU lists (``CUDA_VISIBLE_DEVICES``) for the attention
    server and for the FFN ranks, which split theirs into equal consecutive
    groups, rank k the k-th; None leaves the environment's. An attention
    list shorter than the attention ranks need puts several ranks on each
    GPU (:meth:`attention_ranks_per_device`).
    """

    model: str
    attention_ranks: int = 1
    ffn_ranks: int = 1
    port: int = 8000
    ffn_port: int | None = None
    afd_port: int = DEFAULT_PORT
    host: str = "127.0.0.1"
    connector: str = "p2p"
    gate_on_attention: bool = False
    ubatches: int = 1
    connector_extra_config: dict = field(default_factory=dict)
    vllm_args: list[str] = field(default_factory=list)
    attention_args: list[str] = field(default_factory=list)
    ffn_args: list[str] = field(default_factory=list)
    attention_devices: str | None = None
    ffn_devices: str | None = None
    cpu_workaround: bool | None = None  # None: when no CUDA device is visible

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, vllm_args: list[str]
    ) -> DeploymentSpec:
        """The spec described by the ``launch`` / ``bench`` command lines."""
        return cls(
            model=args.model,
            attention_ranks=args.attention_ranks,
            ffn_ranks=args.ffn_ranks,
            port=args.port,
            ffn_port=args.ffn_port,
            afd_port=args.afd_port,
            host=getattr(args, "host", cls.host),
            connector=args.connector,
            gate_on_attention=args.gate_on_attention,
            ubatches=getattr(args, "ubatches", 1),
            connector_extra_config=args.connector_extra_config,
            vllm_args=vllm_args,
            attention_args=getattr(args, "attention_args", []),
            ffn_args=getattr(args, "ffn_args", []),
            attention_devices=getattr(args, "attention_devices", None),
            ffn_devices=getattr(args, "ffn_devices", None),
        )

    def role_devices(self) -> tuple[str | None, list[str | None]]:
        """``CUDA_VISIBLE_DEVICES`` of the attention server and of each FFN
        rank (None: inherited).

        Raises:
            LaunchError: an empty entry, an FFN list that does not split
                evenly over the FFN ranks, or a GPU given to both roles (the
                NCCL data plane needs one GPU per connector rank).
        """
        attention = _device_list("--attention-devices", self.attention_devices)
        ffn = _device_list("--ffn-devices", self.ffn_devices)
        if ffn and len(ffn) % self.ffn_ranks:
            raise LaunchError(
                f"--ffn-devices lists {len(ffn)} devices for {self.ffn_ranks} FFN "
                "ranks; give every FFN rank the same number"
            )
        shared = [d for d in attention or () if d in (ffn or ())]
        if shared:
            raise LaunchError(
                f"GPU {','.join(shared)} is in both --attention-devices and "
                "--ffn-devices; the NCCL data plane needs each role on its own GPUs"
            )
        per_rank = len(ffn) // self.ffn_ranks if ffn else 0
        ffns = [
            ",".join(ffn[k * per_rank : (k + 1) * per_rank]) if ffn else None
            for k in range(self.ffn_ranks)
        ]
        return (",".join(attention) if attention else None), ffns

    def attention_ranks_per_device(self) -> int:
        """How many attention ranks share each attention device set: more
        than 1 when ``attention_devices`` lists fewer GPUs than the ranks
        need (attention ranks x the attention's ``--tensor-parallel-size``).

        Raises:
            LaunchError: the listed GPUs do not split evenly over the ranks.
        """
        attention = _device_list("--attention-devices", self.attention_devices)
        tp = tensor_parallel_size([*self.vllm_args, *self.attention_args])
        if not attention or len(attention) >= self.attention_ranks * tp:
            return 1
        sets = len(attention) // tp
        if len(attention) % tp or self.attention_ranks % sets:
            raise LaunchError(
                f"--attention-devices lists {len(attention)} GPUs for "
                f"{self.attention_ranks} attention ranks of {tp} GPU(s) each; to "
                "share GPUs, list a number of GPU sets (of the TP size) that "
                "divides the attention ranks"
            )
        return self.attention_ranks // sets

    def plain_devices(self) -> str | None:
        """``CUDA_VISIBLE_DEVICES`` of the plain baseline: every GPU the AFD
        roles were given, so both run on the same hardware."""
        attention, ffns = self.role_devices()
        given = [d for d in (attention, *ffns) if d is not None]
        return ",".join(given) if given else None

    def afd_config(self, role: str) -> dict:
        split = role == "attention" and self.ubatches > 1
        per_device = self.attention_ranks_per_device() if role == "attention" else 1
        return {
            "role": role,
            "connector": self.connector,
            "host": self.host,
            "port": self.afd_port,
            "num_attention_ranks": self.attention_ranks,
            "num_ffn_ranks": self.ffn_ranks,
            "compute_gate_on_attention": self.gate_on_attention,
            "connector_extra_config": self.connector_extra_config,
            **({"num_ubatches": self.ubatches} if split else {}),
            **({"attention_ranks_per_device": per_device} if per_device > 1 else {}),
        }


def _device_list(flag: str, value: str | None) -> list[str] | None:
    if value is None:
        return None
    devices = [d.strip() for d in value.split(",")]
    if not all(devices):
        raise LaunchError(f"{flag}={value!r} has an empty entry; e.g. {flag} 0,1")
    return devices


def vllm_arg(args: Sequence[str], *names: str) -> str | None:
    """The value of option ``names`` in vLLM arguments (``--opt V`` or
    ``--opt=V``; "" when it has none), the last one given winning as in
    vLLM's parser; None when absent."""
    value = None
    for i, arg in enumerate(args):
        name, eq, given = arg.partition("=")
        if name in names:
            value = given if eq else (args[i + 1] if i + 1 < len(args) else "")
    return value


def tensor_parallel_size(args: Sequence[str]) -> int:
    """The ``--tensor-parallel-size`` / ``-tp`` in vLLM arguments (1 if none)."""
    try:
        return int(vllm_arg(args, "--tensor-parallel-size", "-tp") or 1)
    except ValueError:
        return 1


def shared_gpu_memory_args(spec: DeploymentSpec, per_device: int) -> list[str]:
    """``--gpu-memory-utilization`` for attention ranks that share a GPU: each
    gets 0.9 / ranks-per-device, unless the arguments set it."""
    given = [*spec.vllm_args, *spec.attention_args]
    if per_device == 1 or vllm_arg(given, "--gpu-memory-utilization") is not None:
        return []
    return ["--gpu-memory-utilization", f"{0.9 / per_device:.2f}"]


def _wants_cpu_workaround(spec: DeploymentSpec) -> bool:
    if any(a.startswith("--compilation-config") or a == "-cc" for a in spec.vllm_args):
        return False
    if spec.cpu_workaround is not None:
        return spec.cpu_workaround
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True


def serve_argv(model: str, port: int, extra: Sequence[str]) -> list[str]:
    """argv of one ``vllm-afd serve`` process."""
    return [
        sys.executable,
        "-m",
        "vllm_afd.cli.main",
        "serve",
        model,
        "--port",
        str(port),
        *extra,
    ]


def child_env(devices: str | None) -> dict[str, str]:
    """A server process's own environment: this one's, without the parent
    server's pid, with ``CUDA_VISIBLE_DEVICES`` set when ``devices`` is."""
    env = dict(os.environ)
    env.pop("AFD_SERVER_PID", None)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    return env


def role_processes(spec: DeploymentSpec) -> list[RoleProcess]:
    """The processes of ``spec``: FFN ranks first (FFN 0 hosts the rendezvous).

    One ``vllm serve`` per FFN rank (``afd.rank``; ports ``ffn_port + k``) and
    one for the attention role, with ``--data-parallel-size M`` when M > 1.
    """
    common = list(spec.vllm_args)
    if _wants_cpu_workaround(spec):
        common += ["--compilation-config", CPU_COMPILATION_CONFIG]
    ffn_port = spec.ffn_port or spec.port + 1
    attention_devices, ffn_devices = spec.role_devices()
    procs = []
    for k in range(spec.ffn_ranks):
        afd = spec.afd_config("ffn")
        if spec.ffn_ranks > 1:
            afd["rank"] = k
        extra = ["--additional-config", json.dumps({"afd": afd})]
        name = "ffn" if spec.ffn_ranks == 1 else f"ffn{k}"
        argv = serve_argv(spec.model, ffn_port + k, extra + spec.ffn_args + common)
        env = child_env(ffn_devices[k])
        procs.append(RoleProcess(name, argv, ffn_port + k, env))
    afd = spec.afd_config("attention")
    extra = ["--additional-config", json.dumps({"afd": afd})]
    if spec.attention_ranks > 1:
        extra += ["--data-parallel-size", str(spec.attention_ranks)]
    extra += shared_gpu_memory_args(spec, afd.get("attention_ranks_per_device", 1))
    argv = serve_argv(spec.model, spec.port, extra + spec.attention_args + common)
    env = child_env(attention_devices)
    procs.append(RoleProcess("attention", argv, spec.port, env))
    return procs


class Deployment:
    """A running AFD deployment; use as a context manager."""

    def __init__(self, spec: DeploymentSpec, log: IO[str] | None = sys.stdout) -> None:
        self.spec = spec
        self.log = log
        self.processes = role_processes(spec)

    @property
    def api_url(self) -> str:
        return self.attention.url

    @property
    def attention(self) -> RoleProcess:
        return next(p for p in self.processes if p.name == "attention")

    @property
    def ffns(self) -> list[RoleProcess]:
        return [p for p in self.processes if p.name.startswith("ffn")]

    @property
    def ffn(self) -> RoleProcess:
        return self.ffns[0]

    def start(
        self,
        ready_timeout: float = 600.0,
        *,
        attention_first: bool = False,
        stagger_s: float = 0.0,
    ) -> None:
        """Start every role process and wait until all are healthy.

        Roles may start in either order: ``attention_first`` starts the
        attention role ``stagger_s`` seconds before the FFN role.
        """
        order = self.processes[::-1] if attention_first else self.processes
        for i, proc in enumerate(order):
            if i and stagger_s:
                time.sleep(stagger_s)
            proc.start(self.log)
        deadline = time.monotonic() + ready_timeout
        waiting = list(self.processes)
        while waiting:
            self.check_alive()
            waiting = [p for p in waiting if not p.healthy()]
            if waiting and time.monotonic() > deadline:
                names = ", ".join(p.name for p in waiting)
                self.stop()
                raise LaunchError(
                    f"timed out after {ready_timeout:.0f}s waiting for {names} to "
                    "become healthy"
                )
            time.sleep(0.5)

    def dead(self) -> RoleProcess | None:
        return next((p for p in self.processes if p.exit_code() is not None), None)

    def check_alive(self) -> None:
        dead = self.dead()
        if dead is not None:
            code = dead.exit_code()
            self.stop()
            raise LaunchError(f"the {dead.name} process exited with code {code}")

    def stop(self, timeout: float = 30.0) -> None:
        # Attention first: its shutdown tells the FFN to stop.
        for proc in reversed(self.processes):
            proc.stop(timeout)

    def __enter__(self) -> Deployment:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="start and supervise an AFD deployment",
        description="Start every role process, wait until ready, print the API "
        "URL; stop all on Ctrl-C or when one dies. Arguments after `--` go to "
        "every `vllm serve`.",
    )
    p.add_argument("model")
    p.add_argument("-A", "--attention-ranks", type=int, default=1)
    p.add_argument("-F", "--ffn-ranks", type=int, default=1)
    p.add_argument("--port", type=int, default=8000, help="attention API port")
    p.add_argument(
        "--ffn-port", type=int, default=None, help="FFN API port (default: --port + 1)"
    )
    p.add_argument(
        "--afd-port",
        type=int,
        default=DEFAULT_PORT,
        help="connector rendezvous port (afd.port)",
    )
    p.add_argument("--host", default="127.0.0.1", help="connector host (afd.host)")
    p.add_argument("--connector", default="p2p")
    p.add_argument(
        "--gate-on-attention",
        action="store_true",
        help="set afd.compute_gate_on_attention",
    )
    p.add_argument(
        "--ubatches",
        type=int,
        default=1,
        help="afd.num_ubatches of the attention role (2: dual-batch overlap, CUDA)",
    )
    p.add_argument(
        "--connector-extra-config",
        type=json.loads,
        default={},
        help="JSON object for afd.connector_extra_config",
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
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.set_defaults(vllm_args=[])  # main() puts everything after `--` here
    p.set_defaults(func=run_launch)


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


def run_launch(args: argparse.Namespace) -> int:
    spec = DeploymentSpec.from_args(args, list(args.vllm_args))
    try:
        deployment = Deployment(spec)
    except LaunchError as exc:
        print(f"vllm-afd launch: {exc}", file=sys.stderr, flush=True)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        deployment.start(args.ready_timeout)
        print(
            f"AFD {spec.attention_ranks}A{spec.ffn_ranks}F ready: "
            f"{deployment.api_url}/v1",
            flush=True,
        )
        while not stop.is_set():
            deployment.check_alive()
            stop.wait(1.0)
    except KeyboardInterrupt:
        pass
    except LaunchError as exc:
        print(f"vllm-afd launch: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        deployment.stop()
    return 0


class PlainServer:
    """Plain vLLM (no AFD) on the spec's model and settings: the baseline."""

    def __init__(
        self,
        spec: DeploymentSpec,
        log: IO[str] | None = sys.stdout,
        port: int | None = None,
    ) -> None:
        common = list(spec.vllm_args)
        if _wants_cpu_workaround(spec):
            common += ["--compilation-config", CPU_COMPILATION_CONFIG]
        self.process = RoleProcess(
            "plain",
            serve_argv(spec.model, port or spec.port, common),
            port or spec.port,
            child_env(spec.plain_devices()),
        )
        self.log = log

    @property
    def url(self) -> str:
        return self.process.url

    def start(self, ready_timeout: float = 600.0) -> None:
        self.process.start(self.log)
        deadline = time.monotonic() + ready_timeout
        while not self.process.healthy():
            code = self.process.exit_code()
            if code is not None:
                raise LaunchError(f"plain vLLM exited with code {code}")
            if time.monotonic() > deadline:
                self.stop()
                raise LaunchError("timed out waiting for plain vLLM to become healthy")
            time.sleep(0.5)

    def stop(self, timeout: float = 30.0) -> None:
        self.process.stop(timeout)

    def __enter__(self) -> PlainServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
