"""The single source of connector names, their options, and their builders.

``config.parse_afd_config`` asks :func:`canonical_name` and
:func:`validate_extra_config`; workers call :func:`create_connector`.

    name       aliases                 builder
    p2p        P2pNcclAFDConnector     vllm_afd.connector.p2p:build
    loopback   -                       vllm_afd.connector.loopback:build
    async      -                       vllm_afd.connector.async_ep:build

``p2p`` and ``loopback`` build the synchronous exchange (``AFDConnector``:
step plans, blocks of attention ranks per FFN rank); ``async`` builds the
expert-parallel one (``async_ep``: work items, every rank with every rank),
through :func:`create_async_endpoint`.

A builder is named by a ``"module:function"`` string, as vLLM's KV-connector
factory names its connectors, and imported only when a connector is built:
this module imports nothing of the package but its errors (the config module
imports it; it imports neither the config nor the connectors), nor vLLM, nor
torch at module level (config parsing stays light).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_afd.errors import AFDConfigError

#: the ``async`` connector's payload planes (its option ``payload``)
ASYNC_PAYLOADS = ("socket", "shared", "cuda_ipc")
#: the planes that carry payloads in the receiver's slot rings (all but socket)
ASYNC_SLOT_PAYLOADS = ASYNC_PAYLOADS[1:]

if TYPE_CHECKING:
    import torch

    from vllm_afd.config import AFDConfig
    from vllm_afd.connector.async_ep import AsyncEndpoint
    from vllm_afd.connector.connector import AFDConnector
    from vllm_afd.connector.protocol import Fingerprint


@dataclass(frozen=True)
class Option:
    """One ``connector_extra_config`` key.

    Attributes:
        kind: ``float``, ``int``, ``str`` or ``bool``; a float option accepts ints.
        default: value used when the key is absent.
        doc: one line for docs and error messages.
        choices: allowed values of a ``str`` option, or None for any.
        check: why a value (of the right kind) is unusable, or None.
    """

    kind: type
    default: Any
    doc: str
    choices: tuple[str, ...] | None = None
    check: Callable[[Any], str | None] | None = None


@dataclass(frozen=True)
class ExchangeLimits:
    """What the worker knows about the exchanges ahead (sizes buffers that
    must exist before the first step, e.g. cuda_ipc's shared ones).

    Attributes:
        max_tokens: the most tokens one ubatch of an attention rank carries
            (vLLM's ``max_num_batched_tokens``).
        ubatches: micro-batches per step (``afd.num_ubatches``).
    """

    max_tokens: int = 8192
    ubatches: int = 1


_TIMEOUTS = {
    "timeout_s": Option(
        float, 60.0, "every per-step blocking wait (plan of a lagging peer, A2F, F2A)"
    ),
    "connect_timeout_s": Option(
        float, 600.0, "rendezvous + handshake at start(); roles may start in any order"
    ),
    "warmup_timeout_s": Option(
        float,
        600.0,
        "per-step waits of WARMUP/CAPTURE steps (the attention role compiles, "
        "profiles and captures graphs in them)",
    ),
}


@dataclass(frozen=True)
class ConnectorSpec:
    """A registered connector: its names, options and builder.

    Attributes:
        builder: ``"module:function"``; the function takes (config, role_rank,
            fingerprint, device, topology, options, limits) and returns an
            unstarted ``AFDConnector``.
    """

    name: str
    aliases: tuple[str, ...]
    options: Mapping[str, Option]
    builder: str
    asynchronous: bool = False

    def load_builder(self) -> Callable[..., Any]:
        """Import the builder (the connector's modules load only here)."""
        module, _, function = self.builder.partition(":")
        return getattr(importlib.import_module(module), function)


def _check_secret_file(path: str) -> str | None:
    from vllm_afd.connector.auth import check_secret_file

    return check_secret_file(path)


#: the rendezvous' shared secret (p2p and async share the rendezvous)
_SECRET_FILE = Option(
    str,
    "",
    "file holding the shared secret that authenticates the "
    "rendezvous (or set AFD_SECRET); the same on every role",
    check=_check_secret_file,
)

_SPECS: tuple[ConnectorSpec, ...] = (
    ConnectorSpec(
        name="loopback",
        aliases=(),
        options=dict(_TIMEOUTS),
        builder="vllm_afd.connector.loopback:build",
    ),
    ConnectorSpec(
        name="p2p",
        aliases=("P2pNcclAFDConnector",),
        options={
            **_TIMEOUTS,
            "backend": Option(
                str,
                "auto",
                "data plane: auto (nccl for cuda devices, else gloo), gloo, "
                "nccl, cuda_ipc (CUDA IPC buffers and device flags, both roles "
                "on one host; vllm-afd launch picks it when they share a GPU)",
                ("auto", "gloo", "nccl", "cuda_ipc"),
            ),
            "allow_time_slicing": Option(
                bool,
                False,
                "cuda_ipc with both roles on one GPU and no MPS daemon: run "
                "anyway (each exchange waits for a time slice, milliseconds) "
                "instead of refusing",
            ),
            "ipc_copy": Option(
                str,
                "ce",
                "cuda_ipc: how a send moves its payload into the shared buffer: "
                "ce (a device copy, then a flag kernel) or sm (one Triton kernel "
                "copies and stores the flag)",
                ("ce", "sm"),
            ),
            "heartbeat_interval_s": Option(
                float,
                1.0,
                "how often an FFN rank sends a heartbeat to each attention peer "
                "(default 1 s, at most timeout_s / 4); an attention rank that "
                "hears nothing for timeout_s counts the FFN rank as gone (hung, "
                "stopped or cut off)",
            ),
            "secret_file": _SECRET_FILE,
        },
        builder="vllm_afd.connector.p2p:build",
    ),
    ConnectorSpec(
        name="async",
        aliases=(),
        options={
            **_TIMEOUTS,
            "payload": Option(
                str,
                "socket",
                "how work items' rows and replies travel: socket (on the TCP "
                "connection, any hosts), shared (the receiver's slot ring in "
                "shared memory, only the header on the connection; every role "
                "on one host) or cuda_ipc (the receiver's slot ring in its GPU's "
                "memory, mapped by the sender: rows go device to device; every "
                "role on one host's GPUs)",
                ASYNC_PAYLOADS,
            ),
            "secret_file": _SECRET_FILE,
        },
        builder="vllm_afd.connector.async_ep:build",
        asynchronous=True,
    ),
)
_BY_NAME = {s.name: s for s in _SPECS}
_ALIASES = {a: s.name for s in _SPECS for a in (s.name, *s.aliases)}


def registered_names() -> tuple[str, ...]:
    """Canonical names of every registered connector, sorted."""
    return tuple(sorted(_BY_NAME))


def canonical_name(name: str) -> str:
    """Resolve an alias to the canonical connector name.

    Raises:
        AFDConfigError: ``name`` is not registered; lists the registered names.
    """
    if isinstance(name, str) and name in _ALIASES:
        return _ALIASES[name]
    raise AFDConfigError(
        f"afd.connector={name!r} is not a registered connector; registered: "
        f"{', '.join(registered_names())} (aliases: "
        f"{', '.join(sorted(a for a in _ALIASES if a not in _BY_NAME))})"
    )


#: the longest blocking wait a timeout option may ask for (a week): beyond it
#: a deadline overflows the clocks the waits use
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def option_names() -> frozenset[str]:
    """Every ``connector_extra_config`` key of any registered connector."""
    return frozenset(k for s in _BY_NAME.values() for k in s.options)


def spec(name: str) -> ConnectorSpec:
    """The :class:`ConnectorSpec` of ``name`` (an alias is fine)."""
    return _BY_NAME[canonical_name(name)]


def _check_option(name: str, key: str, value: Any, opt: Option) -> Any:
    where = f"afd.connector_extra_config.{key}={value!r}"
    if opt.kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        want = "a number"
    elif opt.kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        want = "an integer"
    else:
        ok = isinstance(value, opt.kind)
        want = {bool: "true or false", str: "a string"}.get(opt.kind, opt.kind.__name__)
    if not ok:
        raise AFDConfigError(
            f"{where} has type {type(value).__name__}; it must be {want} ({opt.doc})"
        )
    if opt.choices is not None and value not in opt.choices:
        raise AFDConfigError(
            f"{where} is not one of {', '.join(opt.choices)} for connector {name!r}"
        )
    if opt.kind is float:
        if not math.isfinite(value) or value > MAX_TIMEOUT_S:
            raise AFDConfigError(
                f"{where} must be a finite number of seconds, at most "
                f"{MAX_TIMEOUT_S:.0f} (7 days)"
            )
        if value <= 0:
            raise AFDConfigError(f"{where} must be > 0 seconds")
        value = float(value)
    why = opt.check(value) if opt.check is not None else None
    if why is not None:
        raise AFDConfigError(f"{where} {why}")
    return value


def validate_extra_config(
    name: str, extra: Mapping[str, Any], afd_keys: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """Check ``connector_extra_config`` against the connector's options.

    ``afd_keys`` (the keys of ``afd`` itself) turns a key put one level too
    deep into a hint where it belongs.

    Returns:
        A new dict with every option of the connector, defaults filled in.

    Raises:
        AFDConfigError: not a mapping, unknown key (naming the valid keys), or
            a value of the wrong type or out of range.
    """
    s = spec(name)
    if not isinstance(extra, Mapping):
        raise AFDConfigError(
            f"afd.connector_extra_config must be a JSON object, got "
            f"{type(extra).__name__}"
        )
    out: dict[str, Any] = {}
    for key, value in extra.items():
        opt = s.options.get(key)
        if opt is None:
            hint = (
                f"; it is a key of afd itself: put it at afd.{key}"
                if key in afd_keys
                else ""
            )
            raise AFDConfigError(
                f"afd.connector_extra_config.{key} is not an option of connector "
                f"{s.name!r}{hint}; valid keys: {', '.join(sorted(s.options))}"
            )
        out[key] = _check_option(s.name, key, value, opt)
    beat_given = "heartbeat_interval_s" in out
    for key, opt in s.options.items():
        out.setdefault(key, opt.default)
    beat = out.get("heartbeat_interval_s")
    if beat is not None and not beat_given:
        out["heartbeat_interval_s"] = beat = min(beat, out["timeout_s"] / 4)
    if beat is not None and beat >= out["timeout_s"]:
        raise AFDConfigError(
            f"afd.connector_extra_config.heartbeat_interval_s={beat:g} must be "
            f"shorter than timeout_s={out['timeout_s']:g}: an FFN rank is counted "
            "as gone after timeout_s without a heartbeat"
        )
    return out


def _checked(
    config: AFDConfig, role_rank: int
) -> tuple[ConnectorSpec, dict[str, Any], Any]:
    """The connector's spec, its options with defaults, and the topology."""
    s = spec(config.connector)
    extra = validate_extra_config(s.name, config.connector_extra_config)
    topology = config.topology
    n = topology.num_ranks(config.role)
    if not 0 <= role_rank < n:
        raise AFDConfigError(
            f"{config.role.value} rank {role_rank} outside 0..{n - 1} for "
            f"topology {topology.name}"
        )
    config_rank = getattr(config, "rank", None)
    if config_rank is not None and config_rank != role_rank:
        raise AFDConfigError(
            f"afd.rank={config_rank} but the connector was asked for "
            f"{config.role.value} rank {role_rank}"
        )
    return s, extra, topology


def create_connector(
    config: AFDConfig,
    role_rank: int,
    fingerprint: Fingerprint,
    device: torch.device | str = "cpu",
    limits: ExchangeLimits | None = None,
) -> AFDConnector:
    """Build (not start) the synchronous connector endpoint of this process.

    Args:
        config: the parsed afd config (role, connector, address, topology).
        role_rank: this endpoint's rank within its role.
        fingerprint: this role's record of the model, topology and options;
            the rendezvous compares it with the other role's and refuses the
            pair naming every field that differs.
        device: where exchanged tensors live (``cpu`` or a ``cuda`` device).
        limits: sizes of the exchanges ahead (default :class:`ExchangeLimits`).

    Raises:
        AFDConfigError: bad rank or options, or an asynchronous connector
            (:func:`create_async_endpoint` builds those).
    """
    import torch

    s, extra, topology = _checked(config, role_rank)
    if s.asynchronous:
        raise AFDConfigError(
            f"connector {s.name!r} is asynchronous: build it with create_async_endpoint"
        )
    dev = torch.device(device)
    limits = limits or ExchangeLimits(ubatches=getattr(config, "num_ubatches", 1))
    build = s.load_builder()
    return build(config, role_rank, fingerprint, dev, topology, extra, limits)


def create_async_endpoint(
    config: AFDConfig,
    role_rank: int,
    fingerprint: Fingerprint,
    limits: ExchangeLimits | None = None,
    device: torch.device | None = None,
) -> AsyncEndpoint:
    """Build (not start) this process's endpoint of the ``async`` connector
    (``connector.async_ep``); arguments as :func:`create_connector`
    (``limits.max_tokens`` sizes the slot rings of ``payload: shared`` and
    ``cuda_ipc``; ``device``: where the role computes, the GPU of
    ``cuda_ipc`` rings; default the CPU).

    Raises:
        AFDConfigError: bad rank or options, a synchronous connector, or more
            FFN ranks than routed experts.
    """
    import torch

    s, extra, topology = _checked(config, role_rank)
    if not s.asynchronous:
        raise AFDConfigError(f"connector {s.name!r} is not asynchronous")
    build = s.load_builder()
    return build(
        config, role_rank, fingerprint, device or torch.device("cpu"), topology,
        extra, limits or ExchangeLimits(),
    )  # fmt: skip
