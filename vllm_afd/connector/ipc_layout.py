"""Buffer plan and setup records of the ``cuda_ipc`` data plane (pure Python).

Dimensions: N ``max_tokens`` (the most tokens an attention rank puts in one
ubatch), H hidden size, K top-k, P ``moe_output_parts``, U ubatches.

Every attention rank owns one device buffer per FFN peer, allocated once per
process and shared with the FFN rank by a CUDA IPC handle at the handshake:
the attention rank writes A2F into it and waits there for F2A; the FFN rank
opens it, waits there for A2F and writes F2A into it. A buffer starts with
one int64 flag per slot, then the slots' regions, each aligned to
:data:`ALIGN` bytes::

    attention rank's buffer for one FFN rank
    flags [U * 4] int64
    ubatch 0:  a2f hidden   [N, H]      dtype
               topk_weights [N, K]      f32    (gate on attention)
               topk_ids     [N, K]      i32    (gate on attention)
               f2a          [N, H * P]  dtype
    ubatch 1 ...

Because the attention rank owns every byte its CUDA graphs touch, a
restarted FFN rank maps the same memory again and the graphs stay valid.

A slot is (kind, ubatch): ``slot = ubatch * 4 + kind``. The sender counts its
writes per slot and stores the count in the slot's flag after the data; the
receiver waits for the count it expects next. One slot per (kind, ubatch) is
enough: an attention rank sends layer L+1 of a ubatch only after it received
layer L's answer, which the FFN rank sends only after it consumed layer L.

This module imports nothing from torch or vLLM.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_afd.connector.protocol import Kind
from vllm_afd.errors import AFDConfigError, AFDProtocolError

#: byte alignment of every region
ALIGN = 256
KINDS = 4  # slots per ubatch: every Kind, used or not
FLAG_BYTES = 8


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def slot_of(kind: int, ubatch: int) -> int:
    return ubatch * KINDS + kind


@dataclass(frozen=True)
class Region:
    """Where one slot's payload lives in a buffer (bytes)."""

    kind: Kind
    ubatch: int
    offset: int
    nbytes: int

    @property
    def slot(self) -> int:
        return slot_of(self.kind, self.ubatch)


@dataclass(frozen=True)
class Layout:
    """One receive buffer: flags, then regions."""

    ubatches: int
    regions: tuple[Region, ...]
    nbytes: int

    @property
    def num_slots(self) -> int:
        return self.ubatches * KINDS

    def region(self, kind: int, ubatch: int) -> Region:
        for r in self.regions:
            if r.kind == kind and r.ubatch == ubatch:
                return r
        raise AFDProtocolError(
            f"no cuda_ipc buffer for {Kind(kind).name.lower()} ubatch {ubatch}: "
            f"the handshake sized {self.ubatches} ubatch(es) of "
            f"{', '.join(sorted({r.kind.name.lower() for r in self.regions}))}"
        )


@dataclass(frozen=True)
class Shapes:
    """What sizes the buffers (both roles derive it the same way).

    Attributes:
        max_tokens: N.
        ubatches: U.
        hidden: H.
        itemsize: bytes per activation element.
        top_k: K.
        gate: routing travels with the A2F (compute_gate_on_attention).
        moe_output_parts: P.
    """

    max_tokens: int
    ubatches: int
    hidden: int
    itemsize: int
    top_k: int
    gate: bool
    moe_output_parts: int = 1


def _layout(shapes: Shapes, kinds: list[tuple[Kind, int]]) -> Layout:
    offset = _align(shapes.ubatches * KINDS * FLAG_BYTES)
    regions = []
    for u in range(shapes.ubatches):
        for kind, row_bytes in kinds:
            nbytes = shapes.max_tokens * row_bytes
            regions.append(Region(kind, u, offset, nbytes))
            offset += _align(nbytes)
    return Layout(shapes.ubatches, tuple(regions), offset)


def pair_layout(shapes: Shapes) -> Layout:
    """The buffer an attention rank shares with one FFN rank."""
    kinds = [(Kind.A2F_HIDDEN, shapes.hidden * shapes.itemsize)]
    if shapes.gate:
        kinds += [
            (Kind.A2F_TOPK_WEIGHTS, shapes.top_k * 4),
            (Kind.A2F_TOPK_IDS, shapes.top_k * 4),
        ]
    cols = shapes.hidden * shapes.moe_output_parts
    kinds.append((Kind.F2A, cols * shapes.itemsize))
    return _layout(shapes, kinds)


@dataclass(frozen=True)
class Place:
    """Where an endpoint runs: the pair must share a host; one GPU needs MPS.

    Attributes:
        host: host name and boot id (processes of one host agree).
        gpu: the device's UUID.
        mps: an MPS control daemon serves this process's GPU.
    """

    host: str
    gpu: str
    mps: bool


def this_host() -> str:
    """``hostname/boot-id``: equal for two processes iff they share a kernel."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def mps_active(env: Mapping[str, str] | None = None) -> bool:
    """An MPS control daemon is running for this process's pipe directory."""
    environ = os.environ if env is None else env
    pipe = environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipe, "control"))


MPS_HINT = (
    "start the MPS control daemon on that host (as root: "
    "`nvidia-cuda-mps-control -d`, and `echo quit | nvidia-cuda-mps-control` "
    "to stop it) before both roles, or set "
    "afd.connector_extra_config.allow_time_slicing=true to run slowly without "
    "it (every exchange then waits for a time slice, milliseconds)"
)


def check_pair(mine: Place, theirs: Place, who: str, allow_time_slicing: bool) -> None:
    """AFDConfigError when this pair cannot use cuda_ipc (``who``: the pair)."""
    if mine.host != theirs.host:
        raise AFDConfigError(
            f"afd.connector_extra_config.backend='cuda_ipc' needs both ends on one "
            f"host, but {who} run on {theirs.host.split('/')[0]} and "
            f"{mine.host.split('/')[0]}: use backend 'nccl' across hosts"
        )
    if mine.gpu == theirs.gpu and not (mine.mps and theirs.mps):
        if allow_time_slicing:
            return
        raise AFDConfigError(
            f"{who} share one GPU ({mine.gpu}) without MPS: the GPU would "
            f"time-slice their processes and every exchange wait milliseconds; "
            f"{MPS_HINT}"
        )


@dataclass(frozen=True)
class Offer:
    """Attention -> FFN: the attention rank's sizes, place and its buffer
    for this FFN rank (:func:`pair_layout`)."""

    shapes: Shapes
    place: Place
    buffer: dict[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return {
            "backend": "cuda_ipc",
            "shapes": dataclasses.asdict(self.shapes),
            "place": dataclasses.asdict(self.place),
            "buffer": self.buffer,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Offer:
        try:
            return cls(Shapes(**d["shapes"]), Place(**d["place"]), dict(d["buffer"]))
        except (KeyError, TypeError) as e:
            raise AFDProtocolError(f"unreadable cuda_ipc setup record: {e!r}") from None


@dataclass(frozen=True)
class Answer:
    """FFN -> attention: the FFN rank's place (it owns no buffer)."""

    place: Place

    def to_wire(self) -> dict[str, Any]:
        return {"backend": "cuda_ipc", "place": dataclasses.asdict(self.place)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Answer:
        try:
            return cls(Place(**d["place"]))
        except (KeyError, TypeError) as e:
            raise AFDProtocolError(f"unreadable cuda_ipc setup record: {e!r}") from None


def check_shapes(mine: Shapes, theirs: Shapes, who: str) -> None:
    """The FFN rank's view of the dims must equal the attention rank's (the
    fingerprint already matched; this guards the sizes it does not carry)."""
    fields = [
        f.name
        for f in dataclasses.fields(Shapes)
        if f.name not in ("max_tokens", "ubatches")
        and getattr(mine, f.name) != getattr(theirs, f.name)
    ]
    if fields:
        raise AFDProtocolError(
            f"cuda_ipc buffer shapes of {who} differ in {', '.join(fields)}: "
            f"{theirs} vs {mine}"
        )
    if theirs.max_tokens < 1 or not 1 <= theirs.ubatches <= 8:
        raise AFDProtocolError(
            f"cuda_ipc setup of {who} asks for max_tokens={theirs.max_tokens}, "
            f"ubatches={theirs.ubatches}"
        )
