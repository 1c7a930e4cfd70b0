"""The AFD configuration: ``--additional-config '{"afd": {...}}'``.

Phase 1, :func:`parse_afd_config`, turns the raw mapping into a frozen
:class:`AFDConfig` and rejects anything malformed. Phase 2,
:func:`vllm_afd.compat.engine_config.validate_against_vllm`, checks it against
the ``VllmConfig`` when vLLM builds its config (``vllm serve`` start-up), before
any worker process starts.

Every key is documented in ``docs/configuration.md``.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from vllm_afd.connector import factory
from vllm_afd.errors import AFDConfigError
from vllm_afd.roles import AFDRole
from vllm_afd.topology import Topology

AFD_KEY = "afd"
#: the asynchronous connector's name (``connector.async_ep``)
ASYNC = "async"
DEFAULT_PORT = 29650
#: the most micro-batches a step may be split into (afd.num_ubatches): vLLM
#: 0.32 keeps per-micro-batch scratch space for two only
MAX_UBATCHES = 2


@dataclass(frozen=True)
class AFDConfig:
    """A parsed, validated ``additional_config["afd"]``.

    Attributes:
        role: ``attention`` (serves requests) or ``ffn`` (driven by the connector).
        connector: canonical connector name (aliases are resolved).
        host: address of FFN rank 0, where the connector rendezvous listens.
        port: rendezvous port; the connector may also use ``port + 1``.
        num_attention_ranks: attention endpoints in the deployment (A).
        num_ffn_ranks: FFN endpoints in the deployment (F); ``F <= A``, except
            with the ``async`` connector (FFN ranks split the experts).
        compute_gate_on_attention: run router + top-k on attention and ship
            routing with the hidden states; dense MLP layers stay on attention.
            Implied (and required) by the ``async`` connector.
        connector_extra_config: connector-specific options, validated by the
            connector's own schema.
        rank: FFN role only: this server's FFN rank. Every FFN rank runs as
            its own ``vllm serve`` (FFN ranks are independent; vLLM data
            parallelism would couple them). Attention ranks are vLLM
            data-parallel ranks, which keeps them in lockstep.
        num_ubatches: attention role: split each large enough step into
            this many micro-batches, so one micro-batch's attention runs
            while another's activations are in transfer or on the FFN
            (dual-batch overlap at 2). ``p2p`` on CUDA: vLLM's split at half
            the tokens; ``async`` on CPU: two stages cut at a request
            boundary (``worker.stages``). 1 turns it off. The FFN role
            ignores it.
        attention_ranks_per_device: attention role on CUDA: how many
            consecutive attention ranks (vLLM data-parallel ranks) share one
            device set, e.g. 2 puts both ranks of a 2A1F deployment on one
            GPU. 1 gives every rank its own, as vLLM does.
    """

    role: AFDRole
    connector: str = "p2p"
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    num_attention_ranks: int = 1
    num_ffn_ranks: int = 1
    compute_gate_on_attention: bool = False
    connector_extra_config: Mapping[str, Any] = field(
        default_factory=lambda: MappingProxyType({})
    )
    rank: int | None = None
    num_ubatches: int = 1
    attention_ranks_per_device: int = 1

    @property
    def is_async(self) -> bool:
        """The asynchronous (expert-parallel, plan-free) exchange."""
        return self.connector == ASYNC

    @property
    def topology(self) -> Topology:
        """Who talks to whom: every attention rank with every FFN rank for
        the ``async`` connector, blocks of attention ranks per FFN rank
        otherwise."""
        return Topology(
            self.num_attention_ranks, self.num_ffn_ranks, all_to_all=self.is_async
        )

    @property
    def is_attention(self) -> bool:
        return self.role is AFDRole.ATTENTION

    @property
    def is_ffn(self) -> bool:
        return self.role is AFDRole.FFN

    def to_dict(self) -> dict[str, Any]:
        """The config as plain JSON-able values (for ``--additional-config``)."""
        return {
            "role": self.role.value,
            "connector": self.connector,
            "host": self.host,
            "port": self.port,
            "num_attention_ranks": self.num_attention_ranks,
            "num_ffn_ranks": self.num_ffn_ranks,
            "compute_gate_on_attention": self.compute_gate_on_attention,
            "connector_extra_config": dict(self.connector_extra_config),
            **({} if self.rank is None else {"rank": self.rank}),
            **({} if self.num_ubatches == 1 else {"num_ubatches": self.num_ubatches}),
            **(
                {}
                if self.attention_ranks_per_device == 1
                else {"attention_ranks_per_device": self.attention_ranks_per_device}
            ),
        }


_KEYS: dict[str, type] = {
    "role": str,
    "connector": str,
    "host": str,
    "port": int,
    "num_attention_ranks": int,
    "num_ffn_ranks": int,
    "compute_gate_on_attention": bool,
    "connector_extra_config": dict,
    "rank": int,
    "num_ubatches": int,
    "attention_ranks_per_device": int,
}


#: every key of ``additional_config["afd"]``
AFD_KEYS = frozenset(_KEYS)


def _type_name(value: Any) -> str:
    return type(value).__name__


def _check_type(key: str, value: Any, expected: type) -> None:
    # bool is a subclass of int: reject it explicitly where an int is wanted.
    ok = isinstance(value, expected) and not (
        expected is int and isinstance(value, bool)
    )
    if expected is dict:
        ok = isinstance(value, Mapping)
    if not ok:
        want = {int: "an integer", bool: "true or false", str: "a string"}.get(
            expected, "a JSON object"
        )
        raise AFDConfigError(
            f"afd.{key}={value!r} has type {_type_name(value)}; it must be {want}"
        )


def _unknown_key_error(key: str) -> AFDConfigError:

    close = difflib.get_close_matches(key, list(_KEYS), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    if key in factory.option_names():
        hint = (
            f"; {key} is a connector option: put it under "
            f'afd.connector_extra_config, e.g. {{"connector_extra_config": '
            f'{{"{key}": ...}}}}.'
        )
    return AFDConfigError(
        f"unknown key afd.{key}{hint} Valid keys: {', '.join(sorted(_KEYS))}"
    )


def parse_afd_config(raw: Any) -> AFDConfig:
    """Parse ``additional_config["afd"]`` into a frozen :class:`AFDConfig`.

    Args:
        raw: the value found under the ``afd`` key.

    Returns:
        The validated config, with the connector name made canonical.

    Raises:
        AFDConfigError: not a mapping, unknown key, wrong type, or a value out
            of range; the message names the key, the value and the fix.
    """
    if isinstance(raw, AFDConfig):
        return raw
    if not isinstance(raw, Mapping):
        raise AFDConfigError(
            f'additional_config["afd"] must be a JSON object, got '
            f"{_type_name(raw)} {raw!r}"
        )
    for key in raw:
        if key not in _KEYS:
            raise _unknown_key_error(str(key))
    for key, value in raw.items():
        _check_type(key, value, _KEYS[key])
    if "role" not in raw:
        raise AFDConfigError(
            'afd.role is required: set "role": "attention" or "role": "ffn"'
        )

    role_value = raw["role"]
    try:
        role = AFDRole(role_value)
    except ValueError:
        raise AFDConfigError(
            f"afd.role={role_value!r} is not a role; use 'attention' or 'ffn'"
        ) from None

    host = raw.get("host", AFDConfig.host)
    if not host.strip():
        raise AFDConfigError(
            f"afd.host={host!r} is empty; give the address of FFN rank 0, "
            "e.g. '127.0.0.1'"
        )
    port = raw.get("port", AFDConfig.port)
    # The p2p connector also listens on port + 1 (its data-plane store).
    if not 1 <= port <= 65534:
        raise AFDConfigError(
            f"afd.port={port} is outside 1..65534 (afd.port + 1 is used too)"
        )

    num_a = raw.get("num_attention_ranks", AFDConfig.num_attention_ranks)
    num_f = raw.get("num_ffn_ranks", AFDConfig.num_ffn_ranks)
    for key, value in (("num_attention_ranks", num_a), ("num_ffn_ranks", num_f)):
        if value < 1:
            raise AFDConfigError(f"afd.{key}={value} must be at least 1")
    # The connector factory is the single source of connector names and of
    # the keys each connector accepts.
    connector = factory.canonical_name(raw.get("connector", AFDConfig.connector))
    gate_on_attention = raw.get("compute_gate_on_attention", connector == ASYNC)
    if connector == ASYNC and not gate_on_attention:
        raise AFDConfigError(
            "afd.compute_gate_on_attention=false cannot run with the async "
            "connector: its FFN ranks each hold a slice of the experts, so the "
            "attention rank must route (compute the gate) to know which FFN "
            "rank gets which rows; drop the key or set it to true"
        )
    if num_a < num_f and connector != ASYNC:
        raise AFDConfigError(
            f"afd.num_attention_ranks={num_a} must be >= "
            f"afd.num_ffn_ranks={num_f}; each FFN rank serves at least one "
            "attention rank (the async connector allows fewer attention "
            "ranks: its FFN ranks split the experts)"
        )

    rank = raw.get("rank")
    if rank is not None:
        if role is AFDRole.ATTENTION:
            raise AFDConfigError(
                f"afd.rank={rank} is for the FFN role only; attention ranks are "
                "vLLM data-parallel ranks (--data-parallel-size, "
                "--data-parallel-rank), which keep them in lockstep"
            )
        if not 0 <= rank < num_f:
            raise AFDConfigError(
                f"afd.rank={rank} is outside 0..{num_f - 1} (afd.num_ffn_ranks={num_f})"
            )
    elif role is AFDRole.FFN and num_f > 1:
        raise AFDConfigError(
            f"afd.rank is required on the FFN role when afd.num_ffn_ranks={num_f}: "
            f"run one vllm serve per FFN rank with afd.rank=0..{num_f - 1}"
        )

    num_ubatches = raw.get("num_ubatches", AFDConfig.num_ubatches)
    if not 1 <= num_ubatches <= MAX_UBATCHES:
        raise AFDConfigError(
            f"afd.num_ubatches={num_ubatches} is outside 1..{MAX_UBATCHES}; "
            "2 gives dual-batch overlap, 1 turns micro-batching off"
        )
    per_device = raw.get(
        "attention_ranks_per_device", AFDConfig.attention_ranks_per_device
    )
    if not 1 <= per_device <= num_a:
        raise AFDConfigError(
            f"afd.attention_ranks_per_device={per_device} is outside 1..{num_a} "
            f"(afd.num_attention_ranks={num_a})"
        )
    if per_device != 1 and role is AFDRole.FFN:
        raise AFDConfigError(
            f"afd.attention_ranks_per_device={per_device} is for the attention "
            "role only; give each FFN rank its own device"
        )

    extra = factory.validate_extra_config(
        connector, raw.get("connector_extra_config", {}), AFD_KEYS
    )
    return AFDConfig(
        role=role,
        connector=connector,
        host=host,
        port=port,
        num_attention_ranks=num_a,
        num_ffn_ranks=num_f,
        compute_gate_on_attention=gate_on_attention,
        connector_extra_config=MappingProxyType(dict(extra)),
        rank=rank,
        num_ubatches=num_ubatches,
        attention_ranks_per_device=per_device,
    )


def afd_config_from_additional(additional_config: Any) -> AFDConfig | None:
    """Return the AFD config in vLLM's ``additional_config``, or None if absent.

    AFD is on exactly when the ``afd`` key is present.
    """
    if not isinstance(additional_config, Mapping) or AFD_KEY not in additional_config:
        return None
    return parse_afd_config(additional_config[AFD_KEY])


def afd_config_of(vllm_config: Any) -> AFDConfig:
    """The AFD config of a ``VllmConfig`` known to run AFD (in the workers).

    Raises:
        AFDConfigError: ``additional_config`` holds no ``afd`` key.
    """
    afd = afd_config_from_additional(vllm_config.additional_config)
    if afd is None:
        raise AFDConfigError(
            "an AFD worker or model was selected without additional_config['afd']"
        )
    return afd
