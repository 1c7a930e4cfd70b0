"""The AFD connector wire protocol: version, messages, step plans, fingerprint.

Dimensions used in this package::

    T   tokens of one ubatch on one attention rank
    ΣT  tokens of one ubatch merged over the attention peers of an FFN rank
    H   hidden size
    K   top-k (routed experts per token)
    U   ubatches per step

Control messages are JSON objects framed by a 4-byte big-endian length::

    WELCOME   listener -> peer    magic, version, nonce, whether a secret is
                                  required (first frame on every connection)
    HELLO     endpoint -> ffn 0   version, role, role_rank, fingerprint, listen,
                                  auth (the secret's answer to the nonce)
    ACCEPT    ffn 0 -> endpoint   session id, control address of every FFN rank
    REJECT    ffn 0 -> endpoint   reason, differing fingerprint fields
    JOIN      attention -> ffn k  role_rank, session, auth (second leg, k > 0)
    SETUP     attention -> ffn,   the data plane's record (backend; for
              then ffn -> att.    cuda_ipc: sizes and buffer handles), on every
                                  control channel right after ACCEPT; the FFN
                                  side answers with its own or a REJECT
    PLAN      attention -> ffn    step_id, mode, ubatch_tokens
    HEARTBEAT ffn -> attention    nothing (every heartbeat_interval_s)
    SHUTDOWN  either way          reason

Every tensor exchange is identified by an :class:`ExchangeKey` (step, layer,
ubatch, kind) packed into the transport's 31-bit message tag. Gloo matches on it, so a
receiver posted for one exchange never consumes the bytes of another; the
cuda_ipc plane keeps one buffer per (kind, ubatch) and checks a sequence
number per exchange on the device; NCCL pairs by order only.

This module imports nothing from vLLM and nothing from torch.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

from vllm_afd.errors import AFDProtocolError

PROTOCOL_VERSION = 9

#: the first field of every WELCOME: tells a vllm-afd listener from any other
MAGIC = "vllm-afd"

# Frames larger than this are not control messages: the peer speaks another
# protocol (or is not a vllm-afd endpoint at all).
MAX_FRAME_BYTES = 1 << 20
_LEN = struct.Struct(">I")


class MsgType(str, enum.Enum):
    """Control-plane message types."""

    WELCOME = "WELCOME"
    HELLO = "HELLO"
    ACCEPT = "ACCEPT"
    REJECT = "REJECT"
    JOIN = "JOIN"
    PLAN = "PLAN"
    SHUTDOWN = "SHUTDOWN"
    HEARTBEAT = "HEARTBEAT"
    SETUP = "SETUP"


class ExecMode(enum.IntEnum):
    """How the attention role runs a step; the FFN role mirrors it."""

    EAGER = 0
    WARMUP = 1
    CAPTURE = 2
    REPLAY = 3


class Kind(enum.IntEnum):
    """What one tensor exchange carries (2 bits of the tag)."""

    A2F_HIDDEN = 0
    A2F_TOPK_WEIGHTS = 1
    A2F_TOPK_IDS = 2
    F2A = 3


_KIND_TEXT = {
    Kind.A2F_HIDDEN: "a2f",
    Kind.A2F_TOPK_WEIGHTS: "a2f topk_weights",
    Kind.A2F_TOPK_IDS: "a2f topk_ids",
    Kind.F2A: "f2a",
}

# Tag layout (31 bits, the transport tag is a signed 32-bit int):
#   [30..15] step_id mod 2^16 | [14..5] layer_idx | [4..2] ubatch_idx | [1..0] kind
STEP_BITS, LAYER_BITS, UBATCH_BITS, KIND_BITS = 16, 10, 3, 2
MAX_LAYERS = 1 << LAYER_BITS
MAX_UBATCHES = 1 << UBATCH_BITS
UBATCH_SHIFT = KIND_BITS
LAYER_SHIFT = UBATCH_SHIFT + UBATCH_BITS
STEP_SHIFT = LAYER_SHIFT + LAYER_BITS
_STEP_MASK = (1 << STEP_BITS) - 1


def step_tag(step_id: int) -> int:
    """The step bits of every tag of step ``step_id``; OR in the rest with
    :func:`exchange_tag` (the connector's hot path builds tags from ints)."""
    return (step_id & _STEP_MASK) << STEP_SHIFT


def exchange_tag(step_bits: int, layer_idx: int, ubatch_idx: int, kind: int) -> int:
    """The 31-bit transport tag of one exchange (``ExchangeKey.tag``)."""
    return step_bits | layer_idx << LAYER_SHIFT | ubatch_idx << UBATCH_SHIFT | kind


def ubatches(n: int) -> str:
    """``"1 ubatch"``, ``"2 ubatches"`` (for messages)."""
    return f"{n} ubatch" if n == 1 else f"{n} ubatches"


class ExchangeKey(NamedTuple):
    """Identity of one tensor exchange."""

    step_id: int
    layer_idx: int
    ubatch_idx: int
    kind: Kind

    @property
    def tag(self) -> int:
        """The 31-bit transport tag of this exchange."""
        return exchange_tag(
            step_tag(self.step_id), self.layer_idx, self.ubatch_idx, int(self.kind)
        )

    @classmethod
    def from_tag(cls, tag: int, step_id: int) -> ExchangeKey:
        """The exchange of ``tag``, whose step is ``step_id`` or the latest
        step before it with the same low bits (tags keep 16 bits of it)."""
        back = (step_id - (tag >> STEP_SHIFT)) & _STEP_MASK
        return cls(
            step_id - back,
            (tag >> LAYER_SHIFT) & (MAX_LAYERS - 1),
            (tag >> UBATCH_SHIFT) & (MAX_UBATCHES - 1),
            Kind(tag & ((1 << KIND_BITS) - 1)),
        )

    def describe(self, peer: str = "") -> str:
        """E.g. ``f2a from ffn rank 0 (step 12, layer 3, ubatch 0)``."""
        sep = " " if peer else ""
        return (
            f"{_KIND_TEXT[self.kind]}{sep}{peer} (step {self.step_id}, "
            f"layer {self.layer_idx}, ubatch {self.ubatch_idx})"
        )


@dataclass(frozen=True)
class StepPlan:
    """One forward step of one attention rank (wire record).

    Attributes:
        step_id: attention forward counter, starts at 0, +1 per step.
        mode: execution mode of the step; all peers of an FFN rank agree.
        ubatch_tokens: ``[U]`` tokens per ubatch on this rank; all zeros (or
            empty) for a rank with no work this step.
    """

    step_id: int
    mode: ExecMode
    ubatch_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.step_id < 0:
            raise AFDProtocolError(f"StepPlan.step_id={self.step_id} is negative")
        if len(self.ubatch_tokens) > MAX_UBATCHES:
            raise AFDProtocolError(
                f"StepPlan has {len(self.ubatch_tokens)} ubatches; at most "
                f"{MAX_UBATCHES} are supported"
            )
        if any(n < 0 for n in self.ubatch_tokens):
            raise AFDProtocolError(
                f"StepPlan.ubatch_tokens={self.ubatch_tokens} has a negative count"
            )

    @property
    def num_tokens(self) -> int:
        return sum(self.ubatch_tokens)

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": MsgType.PLAN.value,
            "step_id": self.step_id,
            "mode": int(self.mode),
            "ubatch_tokens": list(self.ubatch_tokens),
        }

    @classmethod
    def from_wire(cls, msg: dict[str, Any]) -> StepPlan:
        try:
            return cls(
                step_id=int(msg["step_id"]),
                mode=ExecMode(int(msg["mode"])),
                ubatch_tokens=tuple(int(n) for n in msg["ubatch_tokens"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise AFDProtocolError(f"malformed PLAN message {msg!r}: {e}") from None


@dataclass(frozen=True)
class Fingerprint:
    """What both roles must agree on before any tensor moves (wire record).

    Attributes:
        arch: model architecture name, e.g. ``DeepseekV2ForCausalLM``.
        hidden_size: H.
        dtype: activation dtype name as torch spells it, e.g. ``bfloat16``.
        num_layers: decoder layers.
        moe_layers: indices of the MoE decoder layers.
        num_experts: routed experts per MoE layer.
        top_k: K, routed experts per token.
        num_attention_ranks: A.
        num_ffn_ranks: F.
        compute_gate_on_attention: routing is computed by attention and shipped.
        connector: canonical connector name.
        moe_output_parts: F2A columns of an MoE layer, in units of H: 1 (the
            MoE output) or 2 (shared then routed expert outputs, which the
            attention role adds; see ``vllm_afd.models.moe_tail``).
        remote_layers: layers whose MLP/MoE the FFN role serves, in order.
        model_digest: which checkpoint, config, dtype and quantization the
            role loaded (``vllm_afd.worker.identity``); same shapes with other
            weights differ here.
    """

    arch: str
    hidden_size: int
    dtype: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    num_attention_ranks: int
    num_ffn_ranks: int
    compute_gate_on_attention: bool
    connector: str
    moe_output_parts: int = 1
    remote_layers: tuple[int, ...] = ()
    model_digest: str = ""

    def to_wire(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["moe_layers"] = list(self.moe_layers)
        d["remote_layers"] = list(self.remote_layers)
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Fingerprint:
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in d]
        if missing:
            raise AFDProtocolError(f"fingerprint lacks fields {missing}")
        kw = {n: d[n] for n in names}
        kw["moe_layers"] = tuple(kw["moe_layers"])
        kw["remote_layers"] = tuple(kw["remote_layers"])
        return cls(**kw)

    def diff(self, other: Fingerprint) -> list[str]:
        """Names of the fields whose values differ, in declaration order."""
        return [
            f.name
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]

    def describe_diff(self, other: Fingerprint, mine: str, theirs: str) -> str:
        """``field: mine=value theirs=value`` for every differing field."""
        return "; ".join(
            f"{n}: {mine}={getattr(self, n)!r} {theirs}={getattr(other, n)!r}"
            for n in self.diff(other)
        )

    @property
    def digest(self) -> str:
        """First 12 hex digits of the sha256 of the canonical JSON form."""
        blob = json.dumps(self.to_wire(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def encode(msg: dict[str, Any]) -> bytes:
    """One framed control message: 4-byte big-endian length + UTF-8 JSON."""
    body = json.dumps(msg, separators=(",", ":")).encode()
    return _LEN.pack(len(body)) + body


def decode_frames(buf: bytearray) -> list[dict[str, Any]]:
    """Pop every complete frame off the front of ``buf`` and decode it.

    Raises:
        AFDProtocolError: a frame is oversized, not JSON, or has no known type.
    """
    out: list[dict[str, Any]] = []
    while len(buf) >= _LEN.size:
        (n,) = _LEN.unpack_from(buf)
        if n > MAX_FRAME_BYTES:
            raise AFDProtocolError(
                f"control frame of {n} bytes exceeds {MAX_FRAME_BYTES}; the peer "
                "does not speak the vllm-afd protocol"
            )
        if len(buf) < _LEN.size + n:
            break
        body = bytes(buf[_LEN.size : _LEN.size + n])
        del buf[: _LEN.size + n]
        out.append(decode(body))
    return out


def decode(body: bytes) -> dict[str, Any]:
    """Decode one frame body (without its length prefix)."""
    try:
        msg = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AFDProtocolError(f"undecodable control frame: {e}") from None
    if not isinstance(msg, dict) or msg.get("type") not in MsgType._value2member_map_:
        raise AFDProtocolError(f"control frame has no known message type: {msg!r}")
    return msg


def welcome(nonce: str, secret_required: bool) -> dict[str, Any]:
    return {
        "type": MsgType.WELCOME.value,
        "magic": MAGIC,
        "version": PROTOCOL_VERSION,
        "nonce": nonce,
        "secret_required": secret_required,
    }


def hello(
    role: str,
    role_rank: int,
    fingerprint: Fingerprint,
    listen: tuple[str, int] | None,
    auth: str | None = None,
) -> dict[str, Any]:
    return {
        "type": MsgType.HELLO.value,
        "version": PROTOCOL_VERSION,
        "role": role,
        "role_rank": role_rank,
        "fingerprint": fingerprint.to_wire(),
        "listen": list(listen) if listen else None,
        "auth": auth,
    }


def accept(session: str, ffn_addrs: list[tuple[str, int]]) -> dict[str, Any]:
    return {
        "type": MsgType.ACCEPT.value,
        "version": PROTOCOL_VERSION,
        "session": session,
        "ffn_addrs": [list(a) for a in ffn_addrs],
    }


def reject(reason: str, fields: list[str] | None = None) -> dict[str, Any]:
    return {"type": MsgType.REJECT.value, "reason": reason, "fields": fields or []}


def join(role_rank: int, session: str, auth: str | None = None) -> dict[str, Any]:
    return {
        "type": MsgType.JOIN.value,
        "version": PROTOCOL_VERSION,
        "role_rank": role_rank,
        "session": session,
        "auth": auth,
    }


#: how the SHUTDOWN reason of an endpoint that leaves to rendezvous again
#: begins: its peers rendezvous again too, instead of stopping
REJOIN = "rejoin: "


def shutdown(reason: str) -> dict[str, Any]:
    return {"type": MsgType.SHUTDOWN.value, "reason": reason}


def heartbeat() -> dict[str, Any]:
    return {"type": MsgType.HEARTBEAT.value}


def setup(blob: dict[str, Any]) -> dict[str, Any]:
    """The data plane's record for one peer (``DataPlane.setup``), sent on
    each control channel right after the handshake: attention first, its FFN
    rank answers."""
    return {"type": MsgType.SETUP.value, "blob": blob}
