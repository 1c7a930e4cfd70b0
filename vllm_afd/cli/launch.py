"""``vllm-afd launch``: start, watch and stop every role process of a deployment.

One ``vllm serve`` for the attention role (``--data-parallel-size M`` when
M > 1), which answers the OpenAI API, and one per FFN rank (``afd.rank``),
each on its own port, answering no completions. The launcher
waits until both report healthy, prints the API URL, streams each process's
log with a prefix, and stops everything on Ctrl-C, SIGTERM, or when an
attention process exits (naming it). An FFN rank that exits or hangs is
restarted with a backoff (``--ffn-restarts``, ``--ffn-health-timeout``);
the attention ranks rejoin it and serve on.
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
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from vllm_afd import envs
from vllm_afd.cli import placement
from vllm_afd.cli.placement import Placement, PlacementError
from vllm_afd.config import DEFAULT_PORT

#: CPU work-around for vLLM 0.32.0's rotary kernel on DeepSeek (see docs).
CPU_COMPILATION_CONFIG = '{"custom_ops":["all","-rotary_embedding"]}'


class LaunchError(RuntimeError):
    """A role process failed to start or died."""


class DeploymentEnded(LaunchError):
    """An FFN rank stopped by itself because its attention peers shut down
    for good: the deployment was stopped (from another node). Not a failure."""


@dataclass
class RoleProcess:
    """One supervised ``vllm serve`` process."""

    name: str
    argv: list[str]
    port: int
    env: dict[str, str]
    host: str = "127.0.0.1"
    headless: bool = False  # vLLM --headless: no API server, nothing to probe
    proc: subprocess.Popen[bytes] | None = None
    _pump: threading.Thread | None = None
    # supervision (Deployment.supervise): when the process last started,
    # whether it answered /health since, and when /health last answered
    started_at: float = 0.0
    healthy_since_start: bool = False
    last_healthy: float = 0.0
    restarts: int = 0  # in a row: reset once the rank ran STABLE_S
    restart_at: float | None = None
    # FFN: the file (AFD_STOP_NOTE) where the role says why it stopped for good
    stop_note: str | None = None

    @property
    def is_ffn(self) -> bool:
        return self.name.startswith("ffn")

    @property
    def url(self) -> str:
        """Where this machine reaches the server's API."""
        return f"http://{connect_host(self.host)}:{self.port}"

    def start(self, log: IO[str] | None) -> None:
        self.started_at = time.monotonic()
        self.healthy_since_start = False
        env = self.env
        if self.is_ffn:
            if self.stop_note is None:
                fd, self.stop_note = tempfile.mkstemp(prefix=f"afd-{self.name}-")
                os.close(fd)
            Path(self.stop_note).write_text("")
            env = {**env, envs.AFD_STOP_NOTE: self.stop_note}
        self.proc = subprocess.Popen(
            self.argv,
            env=env,
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

    def stopped_for_good(self) -> str | None:
        """FFN: why the role stopped its server because its attention peers
        shut down for good (``AFD_STOP_NOTE``); None if it did not."""
        note = self._stop_note()
        return None if note is None or note.startswith(envs.PEER_DIED) else note

    def peer_died(self) -> str | None:
        """FFN: which attention peer died, and how, when the role stopped its
        server for that (``AFD_STOP_NOTE``); None if it did not."""
        note = self._stop_note()
        if note is None or not note.startswith(envs.PEER_DIED):
            return None
        return note[len(envs.PEER_DIED) :]

    def _stop_note(self) -> str | None:
        if self.stop_note is None:
            return None
        try:
            return Path(self.stop_note).read_text() or None
        except OSError:
            return None

    def forget_stop_note(self) -> None:
        if self.stop_note is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.stop_note)
            self.stop_note = None

    def healthy(self) -> bool:
        if self.headless:
            return self.exit_code() is None
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout: float) -> None:
        """SIGTERM the role's process group (as Ctrl-C reaches every process
        of a terminal's job: the workers close their connectors, which tells
        the peers), SIGKILL the group when the server is not gone after
        ``timeout`` s, or what is left of it :data:`GROUP_GRACE_S` after."""
        self.request_stop()
        self.finish_stop(time.monotonic() + timeout)

    def request_stop(self) -> None:
        """SIGTERM the role's process group (first half of :meth:`stop`)."""
        if self.proc is not None and self.proc.poll() is None:
            _signal_group(self.proc, signal.SIGTERM)

    def finish_stop(self, deadline: float) -> None:
        """Wait for the server until ``deadline`` (monotonic), then SIGKILL
        the group; what is left of it :data:`GROUP_GRACE_S` later too."""
        if self.proc is None:
            return
        try:
            self.proc.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            _signal_group(self.proc, signal.SIGKILL)
            self.proc.wait(10)
        deadline = time.monotonic() + GROUP_GRACE_S
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        _signal_group(self.proc, signal.SIGKILL)


#: seconds a role's engine and workers may outlive its server when it stops
GROUP_GRACE_S = 5.0
#: seconds an FFN rank must run before its restarts in a row count from 0
STABLE_S = 60.0
#: the longest wait before restarting an FFN rank
MAX_BACKOFF_S = 30.0
#: seconds the launcher waits, once an attention process exited, for an FFN
#: rank of its node to say the deployment was stopped (then no failure)
STOP_NOTE_GRACE_S = 5.0
#: seconds a role that is still starting gets to stop on SIGTERM (vLLM 0.32.0
#: defers SIGTERM while its API server waits for the engine to be ready)
STARTING_STOP_S = 5.0


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``; on systems
    without ``/proc``, ``[pgid]`` while the group has any member."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [pgid]
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # after the command name, which may hold spaces and parentheses
            state, _ppid, group = (
                (entry / "stat").read_text().rsplit(")", 1)[1].split()[:3]
            )
        except (OSError, ValueError):
            continue
        if int(group) == pgid and state not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _group_alive(pgid: int) -> bool:
    return bool(group_members(pgid))


#: addresses a server binds on every interface of
WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def connect_host(bind_host: str) -> str:
    """The address a local client uses for a server bound to ``bind_host``."""
    if bind_host in WILDCARD_HOSTS:
        return "127.0.0.1"
    return f"[{bind_host}]" if ":" in bind_host else bind_host


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
    api_host: str | None = None  # None: 127.0.0.1, across hosts the node's
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
    # across hosts (``vllm_afd.cli.placement``); None: everything on this one
    hosts: tuple[str, ...] | None = None
    node_rank: int = 0
    attention_nodes: tuple[int, ...] | None = None
    ffn_nodes: tuple[int, ...] | None = None
    dp_rpc_port: int | None = None  # None: afd_port + 2
    # supervision (Deployment.supervise)
    ffn_restarts: int = 10
    ffn_health_timeout_s: float = 30.0
    ready_timeout_s: float = 600.0

    def placement(self) -> Placement:
        """Node of every rank (everything on node 0 without ``hosts``).

        Raises:
            PlacementError: see :meth:`Placement.make`.
        """
        if self.hosts is None:
            return Placement.single(self.attention_ranks, self.ffn_ranks)
        return Placement.make(
            self.hosts, self.attention_ranks, self.ffn_ranks,
            self.attention_nodes, self.ffn_nodes,
        )  # fmt: skip

    @property
    def multi_host(self) -> bool:
        return self.hosts is not None and len(self.hosts) > 1

    def node_api_host(self, node: int) -> str:
        """What the API servers of ``node`` bind when ``api_host`` is unset."""
        if self.api_host is not None:
            return self.api_host
        return self.placement().hosts[node] if self.multi_host else "127.0.0.1"

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, vllm_args: list[str]
    ) -> DeploymentSpec:
        """The spec described by the ``launch`` / ``bench`` command lines."""
        hosts = getattr(args, "hosts", None)
        return cls(
            model=args.model,
            hosts=tuple(hosts.split(",")) if hosts else None,
            node_rank=getattr(args, "resolved_node_rank", 0),
            attention_nodes=_nodes(getattr(args, "attention_nodes", None)),
            ffn_nodes=_nodes(getattr(args, "ffn_nodes", None)),
            dp_rpc_port=getattr(args, "dp_rpc_port", None),
            attention_ranks=args.attention_ranks,
            ffn_ranks=args.ffn_ranks,
            port=args.port,
            ffn_port=args.ffn_port,
            afd_port=args.afd_port,
            host=getattr(args, "host", cls.host),
            api_host=getattr(args, "api_host", cls.api_host),
            connector=args.connector,
            gate_on_attention=args.gate_on_attention,
            ubatches=getattr(args, "ubatches", 1),
            connector_extra_config=args.connector_extra_config,
            vllm_args=vllm_args,
            attention_args=getattr(args, "attention_args", []),
            ffn_args=getattr(args, "ffn_args", []),
            attention_devices=getattr(args, "attention_devices", None),
            ffn_devices=getattr(args, "ffn_devices", None),
            ffn_restarts=getattr(args, "ffn_restarts", cls.ffn_restarts),
            ffn_health_timeout_s=getattr(
                args, "ffn_health_timeout", cls.ffn_health_timeout_s
            ),
            ready_timeout_s=getattr(args, "ready_timeout", cls.ready_timeout_s),
        )

    def role_devices(self) -> tuple[str | None, list[str | None]]:
        """``CUDA_VISIBLE_DEVICES`` of the attention server and of each FFN
        rank (None: inherited).

        Raises:
            LaunchError: an empty entry, an FFN list that does not split
                evenly over the FFN ranks, or a GPU given to both roles over
                the NCCL data plane (it needs one GPU per connector rank).
        """
        attention = _device_list("--attention-devices", self.attention_devices)
        ffn = _device_list("--ffn-devices", self.ffn_devices)
        if ffn and len(ffn) % self.ffn_ranks:
            raise LaunchError(
                f"--ffn-devices lists {len(ffn)} devices for {self.ffn_ranks} FFN "
                "ranks; give every FFN rank the same number"
            )
        shared = self._shared_gpus()
        if shared and self.data_plane() == "nccl":
            raise LaunchError(
                f"GPU {','.join(shared)} is in both --attention-devices and "
                "--ffn-devices; the NCCL data plane needs each role on its own "
                "GPUs (the cuda_ipc one shares a GPU under MPS: backend "
                "'cuda_ipc' or 'auto' on one host)"
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
        roles were given, so both run on the same hardware, each once (a GPU
        both roles share, listed twice, would hide every GPU from CUDA)."""
        attention, ffns = self.role_devices()
        given = [d for role in (attention, *ffns) if role for d in role.split(",")]
        return ",".join(dict.fromkeys(given)) if given else None

    def _shared_gpus(self) -> list[str]:
        attention = _device_list("--attention-devices", self.attention_devices)
        ffn = _device_list("--ffn-devices", self.ffn_devices)
        return [d for d in attention or () if d in (ffn or ())]

    def data_plane(self) -> str:
        """The p2p backend the CUDA roles will use: ``nccl`` or ``cuda_ipc``.
        ``auto`` is NCCL, except when the device lists give both roles a GPU
        on one host: then the launcher asks for cuda_ipc (NCCL cannot pair
        two ranks on one GPU)."""
        backend = (self.connector_extra_config or {}).get("backend", "auto")
        if backend == "auto":
            one_host = not self.multi_host
            return "cuda_ipc" if one_host and self._shared_gpus() else "nccl"
        return backend

    def _connector_extra(self) -> dict:
        extra = dict(self.connector_extra_config or {})
        if extra.get("backend", "auto") == "auto" and self.data_plane() == "cuda_ipc":
            extra["backend"] = "cuda_ipc"
        return extra

    def afd_config(self, role: str) -> dict:
        split = role == "attention" and self.ubatches > 1
        per_device = self.attention_ranks_per_device() if role == "attention" else 1
        return {
            "role": role,
            "connector": self.connector,
            "host": self.placement().afd_host if self.multi_host else self.host,
            "port": self.afd_port,
            "num_attention_ranks": self.attention_ranks,
            "num_ffn_ranks": self.ffn_ranks,
            "compute_gate_on_attention": self.gate_on_attention,
            "connector_extra_config": self._connector_extra(),
            **({"num_ubatches": self.ubatches} if split else {}),
            **({"attention_ranks_per_device": per_device} if per_device > 1 else {}),
        }


def _nodes(value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return tuple(int(x) for x in value.split(","))
    except ValueError:
        raise PlacementError(
            f"{value!r} is not a list of node ranks, e.g. 0,0,1"
        ) from None


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


def serve_argv(
    model: str, port: int, extra: Sequence[str], host: str = "127.0.0.1"
) -> list[str]:
    """argv of one ``vllm-afd serve`` process, its API bound to ``host``."""
    return [
        sys.executable,
        "-m",
        "vllm_afd.cli.main",
        "serve",
        model,
        "--host",
        host,
        "--port",
        str(port),
        *extra,
    ]


def api_host_of(spec: DeploymentSpec, role_args: Sequence[str], node: int = 0) -> str:
    """The API bind address of a role: a ``--host`` among its vLLM arguments
    (they come last on its command line, so vLLM takes it), else the spec's."""
    given = vllm_arg([*role_args, *spec.vllm_args], "--host")
    return given if given is not None else spec.node_api_host(node)


def child_env(devices: str | None) -> dict[str, str]:
    """A server process's own environment: this one's, without the parent
    server's pid, with this launcher's pid (``AFD_LAUNCHER_PID``: the role
    stops when the launcher is gone, see ``vllm_afd.lifeline``) and
    ``CUDA_VISIBLE_DEVICES`` set when ``devices`` is."""
    env = dict(os.environ)
    env.pop("AFD_SERVER_PID", None)
    env["AFD_LAUNCHER_PID"] = str(os.getpid())
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    return env


def role_processes(
    spec: DeploymentSpec, node: int | None = None, *, check_local: bool = True
) -> list[RoleProcess]:
    """The processes of ``spec`` on ``node`` (default: the spec's node
    rank): FFN ranks first (FFN 0 hosts the rendezvous).

    One ``vllm serve`` per FFN rank (``afd.rank``; ports ``ffn_port + k``) and
    one for the attention role, with ``--data-parallel-size M`` when M > 1;
    across hosts, one attention server per node that holds attention ranks
    (``Placement.attention_flags``), and every process gets its node's
    address and interface (``placement.node_env``; ``check_local``: that
    address must be this host's).

    Raises:
        PlacementError: the placement is not valid, or (``check_local``)
            this node's address is not this host's.
    """
    node = spec.node_rank if node is None else node
    place = spec.placement()
    node_vars = (
        placement.node_env(place.hosts[node], check_local=check_local)
        if spec.multi_host
        else {}
    )
    common = list(spec.vllm_args)
    if _wants_cpu_workaround(spec):
        common += ["--compilation-config", CPU_COMPILATION_CONFIG]
    ffn_port = spec.ffn_port or spec.port + 1
    attention_devices, ffn_devices = spec.role_devices()
    procs = []
    for k in place.ffn_ranks_on(node):
        afd = spec.afd_config("ffn")
        if spec.ffn_ranks > 1:
            afd["rank"] = k
        extra = ["--additional-config", json.dumps({"afd": afd})]
        name = "ffn" if spec.ffn_ranks == 1 else f"ffn{k}"
        host = api_host_of(spec, spec.ffn_args, node)
        argv = serve_argv(
            spec.model, ffn_port + k, extra + spec.ffn_args + common, host
        )
        env = {**child_env(ffn_devices[k]), **node_vars}
        procs.append(RoleProcess(name, argv, ffn_port + k, env, host))
    if not place.attention_ranks_on(node):
        return procs
    afd = spec.afd_config("attention")
    extra = ["--additional-config", json.dumps({"afd": afd})]
    extra += place.attention_flags(node, spec.dp_rpc_port or spec.afd_port + 2)
    extra += shared_gpu_memory_args(spec, afd.get("attention_ranks_per_device", 1))
    host = api_host_of(spec, spec.attention_args, node)
    argv = serve_argv(spec.model, spec.port, extra + spec.attention_args + common, host)
    env = {**child_env(attention_devices), **node_vars}
    headless = node != place.attention_leader
    procs.append(
        RoleProcess("attention", argv, spec.port, env, host, headless=headless)
    )
    return procs


class Deployment:
    """A running AFD deployment; use as a context manager."""

    def __init__(self, spec: DeploymentSpec, log: IO[str] | None = sys.stdout) -> None:
        self.spec = spec
        self.log = log
        self.processes = role_processes(spec)
        self.ready = False

    @property
    def api_url(self) -> str:
        return self.attention.url

    @property
    def attention(self) -> RoleProcess:
        """The attention server of this node.

        Raises:
            LaunchError: this node runs no attention rank.
        """
        found = next((p for p in self.processes if p.name == "attention"), None)
        if found is None:
            raise LaunchError(f"node {self.spec.node_rank} runs no attention rank")
        return found

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
        self.ready = False
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
        self.ready = True

    def dead(self) -> RoleProcess | None:
        return next((p for p in self.processes if p.exit_code() is not None), None)

    def supervise(self, now: float | None = None) -> None:
        """One round of supervision of a ready deployment (``launch`` calls
        it every second): an FFN rank that exited, or whose ``/health`` has
        not answered for ``spec.ffn_health_timeout_s`` (hung: it is
        SIGKILLed), starts again after a backoff of 1, 2, 4 … 30 s; the
        attention ranks rejoin it by themselves. It gives up after
        ``spec.ffn_restarts`` restarts in a row (a rank that then runs
        :data:`STABLE_S` starts the count again).

        Raises:
            DeploymentEnded: an FFN rank stopped by itself because its
                attention peers shut down for good (the deployment was
                stopped, e.g. from the node of its API server), or says so
                within :data:`STOP_NOTE_GRACE_S` of this node's attention
                process exiting; every role is stopped first.
            LaunchError: an attention process exited, or an FFN rank stopped
                by itself because an attention peer died (an attention rank
                cannot rejoin: the deployment stops), an FFN rank exited with
                restarts off or used up; every role is stopped first.
        """
        now = time.monotonic() if now is None else now
        for proc in self.processes:
            code = proc.exit_code()
            if not proc.is_ffn and code is not None:
                # A node's attention server may exit at about the time its FFN
                # rank says the deployment was stopped; that is no failure.
                self._end_if_stopped(within=STOP_NOTE_GRACE_S, deaths=False)
                self.stop()
                raise LaunchError(
                    f"the {proc.name} process exited with code {code}; an "
                    "attention rank cannot rejoin a running deployment, so every "
                    "role stops"
                )
        self._end_if_stopped()
        for proc in self.processes:
            if not proc.is_ffn:
                continue
            if proc.restart_at is not None:
                if now >= proc.restart_at:
                    proc.restart_at = None
                    self._say(f"starting {proc.name} again (restart {proc.restarts})")
                    proc.start(self.log)
                continue
            code = proc.exit_code()
            if code is None and not proc.headless:
                code = self._probe(proc, now)
            if code is None:
                continue
            self._end_if_stopped()  # its word may have come as it exited
            if now - proc.started_at >= STABLE_S:
                proc.restarts = 0
            if proc.restarts >= self.spec.ffn_restarts:
                self.stop()
                why = (
                    "restarts are off (--ffn-restarts 0)"
                    if self.spec.ffn_restarts == 0
                    else f"it failed {proc.restarts} restarts in a row"
                )
                raise LaunchError(
                    f"the {proc.name} process exited with code {code} and {why}"
                )
            proc.restarts += 1
            delay = min(2.0 ** (proc.restarts - 1), MAX_BACKOFF_S)
            proc.restart_at = now + delay
            self._say(
                f"{proc.name} exited with code {code}; restarting it in "
                f"{delay:.0f}s (restart {proc.restarts} of at most "
                f"{self.spec.ffn_restarts} in a row)"
            )

    def _end_if_stopped(self, within: float = 0.0, *, deaths: bool = True) -> None:
        """Raise :class:`DeploymentEnded` (every role stopped first) if an
        FFN rank of this node says it stopped for good, :class:`LaunchError`
        if one says an attention peer died (unless not ``deaths``: the caller
        has a better word for it); wait up to ``within`` s for one to say
        either, unless every FFN rank of the node has exited."""
        deadline = time.monotonic() + within
        while True:
            for proc in self.ffns:
                if (why := proc.stopped_for_good()) is not None:
                    self.stop()
                    raise DeploymentEnded(
                        f"{proc.name} stopped by itself ({why}: the deployment "
                        "was stopped); every role of this node stops"
                    )
                if (why := proc.peer_died()) is not None:
                    if not deaths:
                        return
                    self.stop()
                    raise LaunchError(
                        f"{proc.name} stopped by itself: {why}; an attention rank "
                        "cannot rejoin a running deployment, so every role of "
                        "this node stops"
                    )
            done = all(p.exit_code() is not None for p in self.ffns)
            if done or time.monotonic() >= deadline:
                return
            time.sleep(0.1)

    def _probe(self, proc: RoleProcess, now: float) -> int | None:
        """None while ``proc`` is fine; else what to report as its exit code
        after killing it (it was healthy, and has not answered /health for
        ``ffn_health_timeout_s``, or never answered within ``ready_timeout``)."""
        if proc.healthy():
            proc.healthy_since_start, proc.last_healthy = True, now
            return None
        if proc.healthy_since_start:
            silent = now - proc.last_healthy
            if silent < self.spec.ffn_health_timeout_s:
                return None
            why = f"has not answered /health for {silent:.0f}s (hung)"
        elif now - proc.started_at < self.spec.ready_timeout_s:
            return None
        else:
            why = f"did not become healthy within {self.spec.ready_timeout_s:.0f}s"
        self._say(f"{proc.name} {why}; killing it")
        if proc.proc is not None:
            _signal_group(proc.proc, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.proc.wait(10)
        return proc.exit_code()

    def _say(self, line: str) -> None:
        print(f"vllm-afd launch: {line}", file=sys.stderr, flush=True)

    def check_alive(self) -> None:
        dead = self.dead()
        if dead is not None:
            code = dead.exit_code()
            self.stop()
            raise LaunchError(f"the {dead.name} process exited with code {code}")

    def stop(self, timeout: float = 30.0) -> None:
        """Stop every role. A ready deployment stops attention first (its
        shutdown tells the FFN ranks to stop), each role within ``timeout``
        s; one still starting stops all roles at once, within
        :data:`STARTING_STOP_S`."""
        if not self.ready:
            for proc in self.processes:
                proc.request_stop()
            deadline = time.monotonic() + min(timeout, STARTING_STOP_S)
            for proc in self.processes:
                proc.finish_stop(deadline)
        else:
            for proc in reversed(self.processes):
                proc.stop(timeout)
        for proc in self.processes:
            proc.forget_stop_note()

    def __enter__(self) -> Deployment:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
    p.add_argument("--port", type=int, default=8000, help="attention API port")
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
        help="afd.num_ubatches of the attention role (2: dual-batch overlap, CUDA)",
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
    p.set_defaults(vllm_args=[])  # main() puts everything after `--` here
    p.set_defaults(func=run_launch)


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
        if args.dry_run:
            print(dry_run(spec, only=args.node_rank), flush=True)
            return 0
        deployment = Deployment(spec)
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
        print(ready_line(deployment), flush=True)
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


#: variables ``dry_run`` shows (the rest is the launcher's own environment)
SHOWN_VARIABLES = (
    "CUDA_VISIBLE_DEVICES", "VLLM_HOST_IP", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
)  # fmt: skip


def dry_run(spec: DeploymentSpec, only: int | None = None) -> str:
    """Every node's processes as shell lines (``only``: that node's): the
    variables a process gets beyond the launcher's environment, then its
    ``vllm-afd serve`` command. Interfaces of other hosts than this one show
    as ``<interface of ADDRESS>``."""
    place = spec.placement()
    out = [f"# AFD {spec.attention_ranks}A{spec.ffn_ranks}F on {place.num_nodes} "]
    out[0] += "node" if place.num_nodes == 1 else "nodes"
    out += [f"# {line}" for line in place.describe().splitlines()]
    for node in range(place.num_nodes):
        if only is not None and node != only:
            continue
        out.append(f"## node {node} ({place.hosts[node]})")
        for proc in role_processes(spec, node, check_local=False):
            shown = [
                f"{k}={shlex.quote(proc.env[k])}"
                for k in SHOWN_VARIABLES
                if k in proc.env and proc.env[k] != os.environ.get(k)
            ]
            argv = ["vllm-afd", *proc.argv[3:]]  # [python, -m, module, serve, ...]
            out.append(f"# {proc.name}{' (headless)' if proc.headless else ''}")
            out.append(" ".join([*shown, shlex.join(argv)]))
    return "\n".join(out)


class _Stopped(Exception):
    """SIGTERM arrived while the deployment was starting."""


def ready_line(deployment: Deployment) -> str:
    """The line ``launch`` prints once every role is healthy: the URL a
    client on this machine uses, and the bind address when it is every
    interface."""
    spec = deployment.spec
    name = f"AFD {spec.attention_ranks}A{spec.ffn_ranks}F"
    api = next(
        (p for p in deployment.processes if p.name == "attention" and not p.headless),
        None,
    )
    where = ""
    if spec.multi_host:
        where = f" (node {spec.node_rank} of {len(spec.hosts or ())})"
    if api is None:
        names = ", ".join(
            f"{p.name} (headless)" if p.headless else f"{p.name} ({p.url})"
            for p in deployment.processes
        )
        return f"{name} ready on node {spec.node_rank}: {names}{where}"
    line = f"{name} ready: {api.url}/v1{where}"
    if api.host in WILDCARD_HOSTS:
        line += f" (the API listens on all interfaces, {api.host or '0.0.0.0'})"
    return line


class PlainServer:
    """Plain vLLM (no AFD) on the spec's model and settings: the baseline."""

    def __init__(
        self,
        spec: DeploymentSpec,
        log: IO[str] | None = sys.stdout,
        port: int | None = None,
        name: str = "plain",
    ) -> None:
        common = list(spec.vllm_args)
        if _wants_cpu_workaround(spec):
            common += ["--compilation-config", CPU_COMPILATION_CONFIG]
        host = api_host_of(spec, [])
        self.process = RoleProcess(
            name,
            serve_argv(spec.model, port or spec.port, common, host),
            port or spec.port,
            child_env(spec.plain_devices()),
            host,
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
