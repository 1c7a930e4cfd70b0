"""AFD inside prefill/decode disaggregation: prefill servers (plain vLLM, or
one AFD deployment) hand their KV cache to an AFD decode deployment through
one of vLLM's own KV connectors, with vLLM's router in front.

::

    client -> router (vllm-router --vllm-pd-disaggregation, the one API port)
                -> prefill server k   (plain vllm serve, kv_role kv_producer;
                                       or an AFD deployment's attention role)
                     request with max_tokens=1: computes the prompt's KV cache
                -> decode attention   (the AFD attention role, kv_role kv_consumer)
                     the same request: loads the prompt's KV, decodes
                     <-> FFN ranks    (no KV cache, never a KV connector)

With ``--prefill xAyF`` (``xAyF:async``: the asynchronous connector, the
experts split over the FFN ranks) the prefill side is one AFD deployment of
its own (:func:`prefill_deployment_spec`): its attention role is the KV
producer, its FFN ranks hold no KV cache; a deployment that ends (an
attention role lost, or an FFN rank past its restarts) is started again whole
with the same backoff as a plain prefill server.

The KV connector is vLLM's ``--kv-transfer-config`` (given among the vLLM
arguments); without one, vLLM's reference ``ExampleConnector`` through a
directory of this run (:func:`default_kv_config`: it works on CPU; it keeps
one file per prompt and layer, so it is for trying PD, not for production).
A ``kv_role`` the user gives is kept; otherwise the prefill servers get
``kv_producer`` and the decode attention role ``kv_consumer``.

For comparison, ``plain_decode`` puts one plain vLLM server (the KV
consumer) where the AFD decode deployment would be: PD without AFD, the
baseline of ``vllm-afd bench --prefill``.

Start order: prefill servers (or deployment), then the decode deployment
(FFN ranks, then attention), then the router; stop order: the router, the
decode deployment (attention first), the prefill servers. A prefill server that exits is
started again with a backoff; its requests in flight fail at the router
(HTTP 5xx) and decode serves on.

(Over 500 lines on purpose: the composition's spec, its process list and its
supervision follow the start and stop orders above together; a change to one
side's ports or roles shows in all three.)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllm_afd.deploy.commands import (
    CPU_COMPILATION_CONFIG,
    child_env,
    dry_run,
    memory_budget,
    on_cpu,
    serve_argv,
    wants_cpu_workaround,
)
from vllm_afd.deploy.deployment import MAX_BACKOFF_S, STABLE_S, Deployment
from vllm_afd.deploy.logs import TextSink
from vllm_afd.deploy.memory import MemoryBudget, sets_memory
from vllm_afd.deploy.plain import PlainServer
from vllm_afd.deploy.process import LaunchError, RoleProcess, connect_host
from vllm_afd.deploy.spec import (
    KV_TRANSFER_FLAG,
    DeploymentSpec,
    ffn_kv_refusal,
    visible_gpus,
    vllm_arg,
    without_option,
)
from vllm_afd.errors import AFDConfigError
from vllm_afd.topology import Topology

#: the KV connector of a PD deployment when none is given (vLLM's reference
#: connector: KV through files; works on CPU)
DEFAULT_KV_CONNECTOR = "ExampleConnector"


@dataclass(frozen=True)
class AFDPrefill:
    """The prefill side as one AFD deployment (``--prefill xAyF[:async]``)."""

    attention_ranks: int
    ffn_ranks: int
    connector: str = "p2p"

    @property
    def name(self) -> str:
        tail = ":async" if self.connector == "async" else ""
        return f"{self.attention_ranks}A{self.ffn_ranks}F{tail}"


def parse_prefill(value: str) -> int | AFDPrefill:
    """``--prefill``: a count of plain prefill servers (``2``), or one AFD
    prefill deployment (``1A1F``, ``1A2F:async``).

    Raises:
        LaunchError: neither, or a topology the connector cannot run.
    """
    text = value.strip()
    if text.isdigit():
        return int(text)
    name, sep, connector = text.partition(":")
    a, has_a, f = name.upper().removesuffix("F").partition("A")
    bad_tail = bool(sep) and connector != "async"
    if not has_a or not a.isdigit() or not f.isdigit() or bad_tail:
        raise LaunchError(
            f"--prefill takes a number of plain prefill servers (1) or an AFD "
            f"prefill deployment (1A1F, or 1A2F:async), got {value!r}"
        )
    prefill = AFDPrefill(int(a), int(f), "async" if connector else "p2p")
    try:  # the decode side's rules: at least one rank each, A >= F on p2p
        Topology(prefill.attention_ranks, prefill.ffn_ranks, all_to_all=bool(sep))
    except AFDConfigError as exc:
        raise LaunchError(f"--prefill {value}: {exc}") from None
    return prefill


def kv_transfer_config(args: Sequence[str]) -> dict | None:
    """The ``--kv-transfer-config`` among vLLM arguments, parsed (None when
    absent).

    Raises:
        LaunchError: it is not a JSON object.
    """
    raw = vllm_arg(args, KV_TRANSFER_FLAG)
    if raw is None:
        return None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise LaunchError(
            f"{KV_TRANSFER_FLAG} {raw!r} is not JSON ({exc.msg}); e.g. "
            f'{KV_TRANSFER_FLAG} \'{{"kv_connector": "{DEFAULT_KV_CONNECTOR}"}}\''
        ) from None
    if not isinstance(config, dict) or "kv_connector" not in config:
        raise LaunchError(
            f"{KV_TRANSFER_FLAG} must be a JSON object with a kv_connector, got {raw!r}"
        )
    return config


def default_kv_config(kv_dir: Path) -> dict:
    """vLLM's reference KV connector through files under ``kv_dir``."""
    return {
        "kv_connector": DEFAULT_KV_CONNECTOR,
        "kv_connector_extra_config": {"shared_storage_path": str(kv_dir)},
    }


def side_config(config: dict, kv_role: str) -> str:
    """``config`` as the ``--kv-transfer-config`` of one side: the user's
    ``kv_role`` kept, else ``kv_role``."""
    return json.dumps({"kv_role": kv_role, **config})


#: an AFD prefill deployment's connector port: the decode deployment's + this
#: (the decode side uses its ``afd_port`` and the next two)
PREFILL_AFD_PORT_OFFSET = 3


@dataclass
class PDSpec:
    """A PD deployment: ``prefill`` plain prefill servers (ports
    ``prefill_port + k``) or, with ``prefill_afd``, one AFD prefill deployment
    (its attention API on ``prefill_port``, its FFN ranks after it), the AFD
    ``decode`` deployment, the router on ``port``.

    ``kv_config`` is the KV connector both sides use (None: the default,
    :func:`default_kv_config` under the run's directory); ``prefill_args``
    go to the prefill servers only (every role of an AFD prefill deployment).
    With ``plain_decode`` the decode side is one plain vLLM server instead of
    the AFD deployment (``decode``'s model and vLLM arguments, its attention
    port and memory share): the PD baseline that ``vllm-afd bench --prefill``
    compares AFD with.
    """

    decode: DeploymentSpec
    prefill: int = 1
    prefill_afd: AFDPrefill | None = None
    port: int = 8000
    prefill_port: int | None = None  # None: after the decode ports
    prefill_args: list[str] = field(default_factory=list)
    prefill_devices: str | None = None
    kv_config: dict | None = None
    prefill_restarts: int = 10
    plain_decode: bool = False

    @classmethod
    def make(
        cls,
        decode: DeploymentSpec,
        *,
        prefill: int | AFDPrefill,
        port: int,
        decode_port: int | None = None,
        prefill_port: int | None = None,
        prefill_args: Sequence[str] = (),
        prefill_devices: str | None = None,
        prefill_restarts: int = 10,
        plain_decode: bool = False,
    ) -> PDSpec:
        """The PD spec around ``decode`` (whose ``vllm_args`` may hold a
        ``--kv-transfer-config``: it moves to :attr:`kv_config`), the router
        on ``port``, the decode attention API on ``decode_port`` (default
        ``port + 1``; its FFN ranks after it). ``prefill``: how many plain
        prefill servers, or one AFD prefill deployment. ``plain_decode``: the
        decode side is plain vLLM (:class:`PDSpec`).

        Raises:
            LaunchError: a bad prefill count, a deployment across hosts, a KV
                connector given to the FFN ranks, or a bad
                ``--kv-transfer-config``.
        """
        prefill_afd = prefill if isinstance(prefill, AFDPrefill) else None
        if isinstance(prefill, int) and prefill < 1:
            raise LaunchError(f"--prefill {prefill}: give at least 1 prefill server")
        if decode.multi_host:
            raise LaunchError(
                "--prefill starts prefill servers and the router on this host; "
                "across hosts start them yourself and point a router at the "
                "decode attention API (docs/deployment.md, PD)"
            )
        if vllm_arg(decode.ffn_args, KV_TRANSFER_FLAG) is not None:
            raise LaunchError(ffn_kv_refusal())
        config = kv_transfer_config([*decode.vllm_args, *decode.attention_args])
        decode = dataclasses.replace(
            decode,
            port=decode_port or port + 1,
            vllm_args=without_option(decode.vllm_args, KV_TRANSFER_FLAG),
            attention_args=without_option(decode.attention_args, KV_TRANSFER_FLAG),
        )
        return cls(
            decode=decode,
            prefill=prefill if isinstance(prefill, int) else 1,
            prefill_afd=prefill_afd,
            port=port,
            prefill_port=prefill_port,
            prefill_args=list(prefill_args),
            prefill_devices=prefill_devices,
            kv_config=config,
            prefill_restarts=prefill_restarts,
            plain_decode=plain_decode,
        )

    @property
    def decode_name(self) -> str:
        """``AFD 2A1F`` or ``plain decode``."""
        if self.plain_decode:
            return "plain decode"
        return f"AFD {self.decode.attention_ranks}A{self.decode.ffn_ranks}F"

    @property
    def prefill_processes(self) -> int:
        """Role processes of the prefill side."""
        afd = self.prefill_afd
        return self.prefill if afd is None else afd.attention_ranks + afd.ffn_ranks

    def first_prefill_port(self) -> int:
        ffn_port = self.decode.ffn_port or self.decode.port + 1
        return self.prefill_port or ffn_port + self.decode.ffn_ranks

    def prefill_ports(self) -> int:
        """API ports the prefill side takes from :meth:`first_prefill_port`."""
        if self.prefill_afd is None:
            return self.prefill
        return 1 + self.prefill_afd.ffn_ranks

    def metrics_port(self) -> int:
        """The router's Prometheus port: the one after the prefill servers'."""
        return self.first_prefill_port() + self.prefill_ports()

    @property
    def prefill_name(self) -> str:
        """``2P`` (plain prefill servers) or ``AFD 1A2F:async``."""
        if self.prefill_afd is None:
            return f"{self.prefill}P"
        return f"AFD {self.prefill_afd.name} prefill"


def shares_budget(spec: PDSpec) -> bool:
    """Whether the prefill side takes shares of the decode roles' budget
    (:func:`pd_budget`)."""
    return on_cpu(spec.decode) or prefill_shares_decode_gpu(spec)


def prefill_shares_decode_gpu(spec: PDSpec) -> bool:
    """Whether the prefill side's first GPU is one the decode roles share
    (a one-GPU host): ``--prefill-devices``' first; else an AFD prefill
    deployment's is the decode attention's first and a plain prefill
    server's the first GPU it sees (its devices are inherited). It then
    takes a share of that GPU like an attention rank (an AFD prefill
    deployment's FFN ranks like FFN ranks), where vLLM's default would ask
    for 0.9 of it beside the decode roles."""
    decode = spec.decode
    if on_cpu(decode) or not (shared := decode.shared_gpus()):
        return False
    if spec.prefill_devices:
        devices = spec.prefill_devices
    elif spec.prefill_afd is not None:
        devices = decode.attention_devices or ""
    else:
        devices = ",".join(visible_gpus()[:1])
    return devices.split(",")[0].strip() in shared


def pd_budget(spec: PDSpec) -> MemoryBudget:
    """The decode roles' memory shares (:func:`memory_budget`); on CPU, or
    on a GPU the decode roles share with the prefill side
    (:func:`prefill_shares_decode_gpu`), the prefill servers (an AFD prefill
    deployment's attention ranks) are KV holders beside the attention
    workers and take their share, and an AFD prefill deployment's FFN ranks
    take FFN shares."""
    if not shares_budget(spec):
        return memory_budget(spec.decode)
    afd = spec.prefill_afd
    if afd is None:
        return memory_budget(spec.decode, extra_kv_workers=spec.prefill)
    return memory_budget(
        spec.decode,
        extra_kv_workers=afd.attention_ranks,
        extra_ffn_workers=afd.ffn_ranks,
    )


def prefill_deployment_spec(spec: PDSpec, kv_config: dict) -> DeploymentSpec:
    """The AFD prefill deployment of ``spec`` (``spec.prefill_afd``): the
    decode deployment's model and vLLM arguments plus ``prefill_args``, its
    own topology and connector (``async``: the gate on attention, which that
    connector needs), its attention API on the first prefill port and its FFN
    ranks after it, its connector on the decode side's ``afd_port`` +
    :data:`PREFILL_AFD_PORT_OFFSET`, its attention role the KV producer."""
    afd = spec.prefill_afd
    assert afd is not None
    decode = spec.decode
    first = spec.first_prefill_port()
    return dataclasses.replace(
        decode,
        attention_ranks=afd.attention_ranks,
        ffn_ranks=afd.ffn_ranks,
        connector=afd.connector,
        gate_on_attention=decode.gate_on_attention or afd.connector == "async",
        ubatches=1,
        port=first,
        ffn_port=first + 1,
        afd_port=decode.afd_port + PREFILL_AFD_PORT_OFFSET,
        dp_rpc_port=None,
        vllm_args=[*decode.vllm_args, *spec.prefill_args],
        attention_args=[
            *decode.attention_args,
            KV_TRANSFER_FLAG,
            side_config(kv_config, "kv_producer"),
        ],
        attention_devices=spec.prefill_devices or decode.attention_devices,
        ffn_devices=spec.prefill_devices or decode.ffn_devices,
        ffn_restarts=decode.ffn_restarts,
    )


def consumer_spec(spec: PDSpec, kv_config: dict) -> DeploymentSpec:
    """The decode deployment, its attention role the KV consumer."""
    return dataclasses.replace(
        spec.decode,
        attention_args=[
            *spec.decode.attention_args,
            KV_TRANSFER_FLAG,
            side_config(kv_config, "kv_consumer"),
        ],
    )


def plain_decode_spec(
    spec: PDSpec, kv_config: dict, budget: MemoryBudget
) -> DeploymentSpec:
    """The plain decode server's settings: the decode deployment's model and
    vLLM arguments (its attention role's too), the attention role's memory
    share, the KV consumer."""
    decode = spec.decode
    return dataclasses.replace(
        decode,
        vllm_args=[
            *decode.vllm_args,
            *decode.attention_args,
            *budget.attention_args,
            KV_TRANSFER_FLAG,
            side_config(kv_config, "kv_consumer"),
        ],
        attention_args=[],
    )


class PlainDecode:
    """The decode side of a PD baseline (:attr:`PDSpec.plain_decode`): one
    plain vLLM server on the decode port, the KV consumer."""

    def __init__(
        self, spec: DeploymentSpec, log: TextSink | None, log_dir: Path | None
    ) -> None:
        self.spec = spec
        self.server = PlainServer(spec, log=log, name="decode", log_dir=log_dir)

    @property
    def api_url(self) -> str:
        return self.server.url

    @property
    def processes(self) -> list[RoleProcess]:
        return [self.server.process]

    @property
    def ffns(self) -> list[RoleProcess]:
        return []

    def start(self, ready_timeout: float = 600.0) -> None:
        self.server.start(ready_timeout)

    def supervise(self, now: float | None = None) -> None:
        """Raises LaunchError when the server exited (it is not restarted)."""
        process = self.server.process
        if (code := process.exit_code()) is not None:
            raise LaunchError(f"{process.exited(code)}; every process stops")

    def stop(self, timeout: float = 30.0) -> None:
        self.server.stop(timeout)


def pd_processes(
    spec: PDSpec, kv_config: dict, budget: MemoryBudget
) -> tuple[list[RoleProcess], RoleProcess]:
    """The plain prefill servers (none with an AFD prefill deployment) and
    the router of ``spec`` (not started)."""
    decode = spec.decode
    common = list(decode.vllm_args)
    if wants_cpu_workaround(decode):
        common += ["--compilation-config", CPU_COMPILATION_CONFIG]
    kv = [KV_TRANSFER_FLAG, side_config(kv_config, "kv_producer")]
    host = "127.0.0.1" if decode.api_host is None else decode.api_host
    first = spec.first_prefill_port()
    # on CPU, or on the GPU the decode roles share, the prefill servers'
    # share of the host's KV budget or of the GPU
    mine = sets_memory(spec.prefill_args) or not shares_budget(spec)
    memory = [] if mine else list(budget.attention_args)
    prefills: list[RoleProcess] = []
    if spec.prefill_afd is not None:
        urls = [f"http://{connect_host(host)}:{first}"]
        return prefills, RoleProcess(
            "router", router_argv(spec, urls, host), spec.port, child_env(None), host
        )
    cpu = on_cpu(decode)
    for k in range(spec.prefill):
        name = "prefill" if spec.prefill == 1 else f"prefill{k}"
        argv = serve_argv(
            decode.model, first + k, [*kv, *memory, *spec.prefill_args, *common], host
        )
        env = child_env(spec.prefill_devices, cpu)
        prefills.append(RoleProcess(name, argv, first + k, env, host))
    router = RoleProcess(
        "router",
        router_argv(spec, [p.url for p in prefills], host),
        spec.port,
        child_env(None),
        host,
    )
    return prefills, router


def router_argv(spec: PDSpec, prefill_urls: Sequence[str], host: str) -> list[str]:
    """vLLM's router in PD mode: a request goes to a prefill server with
    ``max_tokens=1``, then whole to the decode attention API."""
    decode_url = f"http://{connect_host(host)}"
    argv = [sys.executable, "-m", "vllm_router.launch_router"]
    argv += ["--vllm-pd-disaggregation", "--host", host, "--port", str(spec.port)]
    for url in prefill_urls:
        argv += ["--prefill", url]
    argv += ["--decode", f"{decode_url}:{spec.decode.port}"]
    argv += ["--policy", "round_robin", "--log-level", "warning"]
    # its Prometheus metrics (/metrics) on the port after the prefill servers
    argv += ["--prometheus-host", host, "--prometheus-port", str(spec.metrics_port())]
    return argv


def check_router_installed() -> None:
    """Raises LaunchError when vLLM's router is not importable."""
    if importlib.util.find_spec("vllm_router") is None:
        raise LaunchError(
            "--prefill puts vLLM's router in front (the vllm-router package), "
            "which is not installed: pip install 'vllm-afd[pd]'"
        )


class PDDeployment:
    """A running PD deployment: prefill servers (or an AFD prefill
    :class:`~vllm_afd.deploy.deployment.Deployment`), an AFD decode
    deployment (or, for a baseline, :class:`PlainDecode`), the router."""

    def __init__(
        self,
        spec: PDSpec,
        log: TextSink | None = sys.stdout,
        log_dir: Path | None = None,
    ) -> None:
        self.spec = spec
        self.log = log
        self.log_dir = log_dir
        self.kv_dir: Path | None = None
        kv_config = spec.kv_config
        if kv_config is None:
            if log_dir is None:
                raise LaunchError("a PD deployment without a KV config needs a log_dir")
            self.kv_dir = log_dir / "kv"
            self.kv_dir.mkdir(parents=True, exist_ok=True)
            kv_config = default_kv_config(self.kv_dir)
        self.kv_config = kv_config
        self.budget = pd_budget(spec)
        self.decode: Deployment | PlainDecode = (
            PlainDecode(plain_decode_spec(spec, kv_config, self.budget), log, log_dir)
            if spec.plain_decode
            else Deployment(
                consumer_spec(spec, kv_config),
                log=log,
                log_dir=log_dir,
                budget=self.budget,
            )
        )
        self.prefills, self.router = pd_processes(spec, kv_config, self.budget)
        self.prefill_deployment: Deployment | None = None
        if spec.prefill_afd is not None:
            prefill = prefill_deployment_spec(spec, kv_config)
            self.prefill_deployment = Deployment(
                prefill,
                log=log,
                log_dir=log_dir,
                # on GPUs of their own its roles share them alone
                budget=self.budget if shares_budget(spec) else None,
                group="prefill-",
            )
        # an AFD prefill deployment that ended: when it starts again, and
        # how many times in a row it has
        self.prefill_restart_at: float | None = None
        self.prefill_restarts = 0
        self.prefill_started_at = 0.0
        if log_dir is not None:
            for proc in [*self.prefills, self.router]:
                proc.log_file = log_dir / f"{proc.name}.log"
        self.ready = False

    @property
    def api_url(self) -> str:
        return self.router.url

    @property
    def processes(self) -> list[RoleProcess]:
        """Every process, in start order."""
        prefill = self.prefill_deployment
        afd = [] if prefill is None else prefill.processes
        return [*self.prefills, *afd, *self.decode.processes, self.router]

    @property
    def prefill_urls(self) -> list[str]:
        """The API of each prefill server (of the AFD prefill deployment)."""
        if self.prefill_deployment is not None:
            return [self.prefill_deployment.api_url]
        return [p.url for p in self.prefills]

    def start(self, ready_timeout: float = 600.0) -> None:
        """Start the prefill servers and the decode deployment together (the
        decode side waits for nothing of prefill), then, once all are healthy,
        the router; wait until it answers too. On a GPU both sides share
        (:func:`prefill_shares_decode_gpu`) the prefill side first, the
        decode side once it is healthy: a vLLM server sizes its KV cache
        from the memory the GPU frees while it starts, so what another
        allocates meanwhile would count as its own (seen: the decode server
        left with no memory for its cache blocks).

        Raises:
            LaunchError: a process exited, or not all were healthy within
                ``ready_timeout`` s (naming which); every process stopped.
        """
        deadline = time.monotonic() + ready_timeout
        one_by_one = prefill_shares_decode_gpu(self.spec)
        for proc in self.prefills:
            proc.start(self.log)
        prefill = self.prefill_deployment
        try:
            if prefill is not None:
                prefill.launch()
                self.prefill_started_at = time.monotonic()
            if one_by_one:
                self._wait_prefill(deadline, ready_timeout)
            self.decode.start(max(deadline - time.monotonic(), 1.0))
            self._wait_prefill(deadline, ready_timeout)
            self.router.start(self.log)
            self._wait([self.router], deadline, ready_timeout)
        except BaseException:
            self.stop()
            raise
        self.ready = True

    def _wait_prefill(self, deadline: float, timeout: float) -> None:
        """Until the prefill side is healthy (or past ``deadline``)."""
        if self.prefill_deployment is not None:
            self.prefill_deployment.wait_ready(max(deadline - time.monotonic(), 1.0))
        self._wait(self.prefills, deadline, timeout)

    def _wait(self, procs: list[RoleProcess], deadline: float, timeout: float) -> None:
        waiting = list(procs)
        while waiting:
            for proc in waiting:
                if (code := proc.exit_code()) is not None:
                    raise LaunchError(proc.exited(code))
            waiting = [p for p in waiting if not p.healthy()]
            if waiting and time.monotonic() > deadline:
                names = ", ".join(p.name for p in waiting)
                raise LaunchError(
                    f"timed out after {timeout:.0f}s waiting for {names} to "
                    "become healthy"
                )
            time.sleep(0.5)

    def supervise(self, now: float | None = None) -> None:
        """One round of supervision: the decode deployment's
        (:meth:`Deployment.supervise`), a prefill server that exited starts
        again after a backoff of 1, 2, 4 … 30 s (at most
        ``spec.prefill_restarts`` in a row).

        Raises:
            LaunchError: the router exited, a prefill server used up its
                restarts, or the decode deployment ended; every process
                stopped first.
        """
        now = time.monotonic() if now is None else now
        try:
            self.decode.supervise(now)
        except LaunchError:
            self.stop()
            raise
        if (code := self.router.exit_code()) is not None:
            self.stop()
            raise LaunchError(f"{self.router.exited(code)}; every process stops")
        if self.prefill_deployment is not None:
            self._supervise_prefill_deployment(self.prefill_deployment, now)
        for proc in self.prefills:
            if proc.restart_at is not None:
                if now >= proc.restart_at:
                    proc.restart_at = None
                    self._say(f"starting {proc.name} again (restart {proc.restarts})")
                    proc.start(self.log)
                continue
            code = proc.exit_code()
            if code is None:
                continue
            if now - proc.started_at >= STABLE_S:
                proc.restarts = 0
            if proc.restarts >= self.spec.prefill_restarts:
                self.stop()
                raise LaunchError(
                    f"{proc.exited(code)}; it failed {proc.restarts} restarts in a row"
                )
            proc.restarts += 1
            delay = min(2.0 ** (proc.restarts - 1), MAX_BACKOFF_S)
            proc.restart_at = now + delay
            self._say(
                f"{proc.exited(code)}; its requests in flight failed; restarting "
                f"it in {delay:.0f}s (restart {proc.restarts})"
            )

    def _supervise_prefill_deployment(self, prefill: Deployment, now: float) -> None:
        """The AFD prefill deployment's own supervision (its FFN ranks
        restart as in any deployment); when it ends, all of it starts again
        after a backoff of 1, 2, 4 … 30 s, at most ``spec.prefill_restarts``
        times in a row. Raises LaunchError (every process stopped) past that."""
        if self.prefill_restart_at is not None:
            if now >= self.prefill_restart_at:
                self.prefill_restart_at = None
                self._say(
                    f"starting the AFD prefill deployment again "
                    f"(restart {self.prefill_restarts})"
                )
                prefill.launch()
                self.prefill_started_at = now
            return
        try:
            prefill.supervise(now)
        except LaunchError as exc:  # DeploymentEnded too: it ended, by itself
            if now - self.prefill_started_at >= STABLE_S:
                self.prefill_restarts = 0
            if self.prefill_restarts >= self.spec.prefill_restarts:
                self.stop()
                raise LaunchError(
                    f"the AFD prefill deployment ended ({exc}); it failed "
                    f"{self.prefill_restarts} restarts in a row"
                ) from None
            self.prefill_restarts += 1
            delay = min(2.0 ** (self.prefill_restarts - 1), MAX_BACKOFF_S)
            self.prefill_restart_at = now + delay
            self._say(
                f"the AFD prefill deployment ended ({exc}); its requests in "
                f"flight failed; starting it again in {delay:.0f}s "
                f"(restart {self.prefill_restarts})"
            )

    def _say(self, line: str) -> None:
        print(f"vllm-afd launch: {line}", file=sys.stderr, flush=True)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the router, then the decode deployment (attention first),
        then the prefill servers (the AFD prefill deployment)."""
        self.router.stop(timeout)
        self.decode.stop(timeout)
        if self.prefill_deployment is not None:
            self.prefill_deployment.stop(timeout)
        for proc in self.prefills:
            proc.request_stop()
        deadline = time.monotonic() + timeout
        for proc in self.prefills:
            proc.finish_stop(deadline)
        self.ready = False

    def __enter__(self) -> PDDeployment:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def pd_ready_line(pd: PDDeployment) -> str:
    spec = pd.spec
    return (
        f"PD {spec.prefill_name} + {spec.decode_name} "
        f"ready: {pd.api_url}/v1 (router; KV connector "
        f"{pd.kv_config['kv_connector']})"
    )


def pd_dry_run(spec: PDSpec, kv_dir: Path) -> str:
    """Every process of ``spec`` as shell lines, in start order."""
    kv = spec.kv_config or default_kv_config(kv_dir)
    budget = pd_budget(spec)
    prefills, router = pd_processes(spec, kv, budget)
    if spec.prefill_afd is None:
        side = f"{spec.prefill} prefill server(s)"
    else:
        side = f"an AFD {spec.prefill_afd.name} prefill deployment"
    decode_side = "plain decode" if spec.plain_decode else "AFD decode"
    out = [f"# PD: {side}, {decode_side}, router on {spec.port}"]
    for proc in prefills:
        out.append(f"# {proc.name}")
        out.append(shlex.join(["vllm-afd", *proc.argv[3:]]))
    if spec.prefill_afd is not None:
        prefill = prefill_deployment_spec(spec, kv)
        shares = budget if shares_budget(spec) else None
        out.append(dry_run(prefill, budget=shares, group="prefill-"))
    if spec.plain_decode:
        server = PlainDecode(plain_decode_spec(spec, kv, budget), None, None).server
        out.append("# decode (plain vLLM, the KV consumer)")
        out.append(shlex.join(["vllm-afd", *server.process.argv[3:]]))
    else:
        out.append(dry_run(consumer_spec(spec, kv), budget=budget))
    out.append("# router")
    out.append(shlex.join(["vllm-router", *router.argv[3:]]))
    return "\n".join(out)
