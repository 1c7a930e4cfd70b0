"""Slot rings of the ``async`` connector's ``payload: shared`` and
``payload: cuda_ipc`` planes.

With ``payload: socket`` (the default) a work item's rows and its reply's
output travel on the TCP connection behind the frame's header. With a slot
plane (every role on one host) only the header does: each receiver keeps,
per peer, a ring of slots, the sender writes the payload into the slot of
the item's sequence number and sends the header with
:data:`~vllm_afd.connector.async_wire.IN_SLOT` set. An FFN rank keeps one
work ring per attention rank, an attention rank one reply ring per FFN rank;
both are mapped by the peer at the handshake (:func:`handshake`).

* ``shared``: the ring is a shared-memory file (:class:`SlotRing`), unlinked
  once both sides hold it, so nothing is left behind whatever ends the
  processes.
* ``cuda_ipc``: the ring is memory on the receiver's GPU (:class:`DeviceRing`),
  which the sender maps through a CUDA IPC handle: rows go device to device,
  never through host memory. The sender's copy into the peer's slot is
  queued on its stream; it waits for that stream before the header leaves,
  so the payload is whole when the receiver reads it. Nothing spins on the
  device: the header on the socket is the signal.

A slot is reused ``depth`` items later. The attention rank never has more
than ``depth`` items in flight to one FFN rank (it reads a reply before it
sends the item that reuses its slot, and with more in flight it sends the
next one on the socket), so an FFN rank has read an item's slot before it is
written again; an attention rank reads each reply before its slot is written
again the same way: an FFN rank replies in a slot only to an item that
came in one. A payload larger than the peer's slot travels on the socket, as
with ``payload: socket``, and so does the reply to an item that did.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm_afd.connector.factory import ASYNC_SLOT_PAYLOADS
from vllm_afd.connector.ipc_layout import this_host
from vllm_afd.connector.protocol import MsgType
from vllm_afd.errors import AFDConfigError, AFDConnectorError, AFDProtocolError

if TYPE_CHECKING:
    from vllm_afd.connector.p2p_wire import Channel

#: where ring files are made: shared memory where the host has it
SHM_DIR = "/dev/shm"
#: the planes whose payloads travel in slot rings
SLOT_PLANES = ASYNC_SLOT_PAYLOADS
#: slots per ring: items one attention rank may have in flight to one FFN
#: rank with their payload in slots (a step cut in two stages has two)
DEPTH = 2


@dataclass(frozen=True)
class RingSize:
    """A receiver's ring: ``depth`` slots of ``slot_bytes`` each."""

    depth: int
    slot_bytes: int


def item_bytes(tokens: int, hidden: int, dtype: torch.dtype, top_k: int) -> int:
    """A work item's payload: ``tokens`` rows of ``hidden`` values, then
    their top-k ids (int32) and weights (float32)."""
    return tokens * (hidden * dtype.itemsize + 8 * top_k)


def work_ring(max_tokens: int, hidden: int, dtype: torch.dtype, top_k: int) -> RingSize:
    """An FFN rank's ring for one attention rank: room for an item of
    ``max_tokens`` rows (:func:`item_bytes`)."""
    return RingSize(DEPTH, item_bytes(max_tokens, hidden, dtype, top_k))


def reply_ring(max_tokens: int, cols: int, dtype: torch.dtype) -> RingSize:
    """An attention rank's ring for one FFN rank: room for a reply of
    ``max_tokens`` rows of ``cols`` columns."""
    return RingSize(DEPTH, max_tokens * cols * dtype.itemsize)


def check_ring_device(payload: str, device: torch.device, who: str) -> None:
    """Refuse ``payload: cuda_ipc`` for a role that computes off the GPU.

    Raises:
        AFDConfigError: naming ``who``, its device and the other planes.
    """
    if payload == "cuda_ipc" and device.type != "cuda":
        raise AFDConfigError(
            f"the async connector's payload 'cuda_ipc' keeps its slot rings in "
            f"GPU memory, and {who} runs on {device}: set payload 'shared' "
            "(one host) or 'socket'"
        )


class _Slots:
    """What both rings share: ``buffer`` holds ``size.depth`` slots."""

    buffer: torch.Tensor
    size: RingSize
    path: str  # what names the ring in errors

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.size.slot_bytes

    def slot(self, seq: int, nbytes: int) -> torch.Tensor:
        """``[nbytes]`` uint8 view of the slot of item ``seq``.

        Raises:
            AFDProtocolError: ``nbytes`` exceeds a slot.
        """
        if not self.fits(nbytes):
            raise AFDProtocolError(
                f"a payload of {nbytes} bytes does not fit the slots of "
                f"{self.size.slot_bytes} bytes of ring {self.path}"
            )
        at = (seq % self.size.depth) * self.size.slot_bytes
        return self.buffer[at : at + nbytes]


class SlotRing(_Slots):
    """``depth`` slots of ``slot_bytes`` in a shared-memory file, mapped.

    The side that receives into the ring makes it (:meth:`create`), the
    sender maps the same file (:meth:`open`); :meth:`unlink` removes the
    file once both hold it (the mapping outlives the name).
    """

    def __init__(self, path: str, size: RingSize, owner: bool) -> None:
        self.path, self.size, self.owner = path, size, owner
        total = size.depth * size.slot_bytes
        self.buffer = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        self._linked = owner

    @classmethod
    def create(cls, size: RingSize, label: str) -> SlotRing:
        """A new ring in a new file, its space reserved now.

        Raises:
            AFDConfigError: the file system has no room for it (its size and
                where, and what to do).
        """
        where = SHM_DIR if os.path.isdir(SHM_DIR) else tempfile.gettempdir()
        fd, path = tempfile.mkstemp(prefix=f"vllm-afd-{label}-", dir=where)
        total = size.depth * size.slot_bytes
        try:
            os.posix_fallocate(fd, 0, max(total, 1))
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            raise AFDConfigError(
                f"the async connector's payload 'shared' could not reserve "
                f"{total / 2**20:.1f} MiB in {where} for a ring of {size.depth} "
                f"slots ({e.strerror}): make room there (a container's "
                "--shm-size), lower max_num_batched_tokens, or set "
                "payload 'socket'"
            ) from None
        os.close(fd)
        try:
            return cls(path, size, owner=True)
        except BaseException:
            os.unlink(path)
            raise

    @classmethod
    def open(cls, record: dict[str, Any]) -> SlotRing:
        """The peer's ring of :meth:`record`.

        Raises:
            AFDConnectorError: its file is gone or smaller than announced.
        """
        size = RingSize(int(record["depth"]), int(record["slot_bytes"]))
        path = str(record["path"])
        try:
            held = os.stat(path).st_size
        except OSError as e:
            raise AFDConnectorError(
                f"cannot map the peer's slot ring {path} ({e.strerror})"
            ) from None
        if held < size.depth * size.slot_bytes:
            raise AFDConnectorError(
                f"the peer's slot ring {path} holds {held} bytes, not the "
                f"{size.depth * size.slot_bytes} it announced"
            )
        return cls(path, size, owner=False)

    def record(self) -> dict[str, Any]:
        """What the peer needs to map this ring (JSON-able)."""
        return {
            "path": self.path,
            "depth": self.size.depth,
            "slot_bytes": self.size.slot_bytes,
        }

    def unlink(self) -> None:
        """Remove the ring's file (the owner's, once the peer mapped it;
        idempotent)."""
        if self._linked:
            self._linked = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class DeviceRing(_Slots):
    """``depth`` slots of ``slot_bytes`` in GPU memory: the receiver's
    (:meth:`create`), or the peer's mapped here through its CUDA IPC handle
    (:meth:`open`; on another GPU of the host through peer access). The
    interface of :class:`SlotRing`; the views it gives are on a GPU."""

    def __init__(self, buffer: torch.Tensor, size: RingSize, label: str) -> None:
        self.buffer, self.size, self.path = buffer, size, label

    @classmethod
    def create(cls, size: RingSize, label: str, device: torch.device) -> DeviceRing:
        """A new ring on ``device``.

        Raises:
            AFDConfigError: ``device`` is not a GPU, or has no room for it.
        """
        total = size.depth * size.slot_bytes
        check_ring_device("cuda_ipc", device, "this role")
        try:
            buffer = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError:
            raise AFDConfigError(
                f"the async connector's payload 'cuda_ipc' could not allocate "
                f"{total / 2**20:.1f} MiB on {device} for a ring of {size.depth} "
                "slots: lower max_num_batched_tokens or --gpu-memory-utilization, "
                "or set payload 'shared'"
            ) from None
        return cls(buffer, size, label)

    @classmethod
    def open(cls, record: dict[str, Any], device: torch.device) -> DeviceRing:
        """The peer's ring of :meth:`record`, mapped on ``device``.

        Raises:
            AFDConnectorError: the handle cannot be opened here (no peer
                access between the GPUs), or holds less than announced.
        """
        from vllm_afd.connector.ipc_data import open_shared

        size = RingSize(int(record["depth"]), int(record["slot_bytes"]))
        buffer = open_shared(record["ipc"], device)
        if buffer.numel() < size.depth * size.slot_bytes:
            raise AFDConnectorError(
                f"the peer's cuda_ipc slot ring holds {buffer.numel()} bytes, not "
                f"the {size.depth * size.slot_bytes} it announced"
            )
        return cls(buffer, size, str(record.get("label", "peer")))

    def record(self) -> dict[str, Any]:
        """What the peer needs to map this ring (JSON-able)."""
        from vllm_afd.connector.ipc_data import share

        return {
            "ipc": share(self.buffer),
            "label": self.path,
            "depth": self.size.depth,
            "slot_bytes": self.size.slot_bytes,
        }

    def unlink(self) -> None:
        """Nothing to remove: the memory goes with the last process holding it."""


Ring = SlotRing | DeviceRing


@dataclass
class Rings:
    """One connection's rings: ``mine`` receives from the peer, ``theirs``
    is the peer's, which this side writes into (both None with ``payload:
    socket``)."""

    mine: Ring | None = None
    theirs: Ring | None = None


def _make_ring(
    payload: str, size: RingSize, label: str, device: torch.device
) -> Ring | None:
    if payload == "shared":
        return SlotRing.create(size, label)
    if payload == "cuda_ipc":
        return DeviceRing.create(size, label, device)
    return None


def _open_ring(payload: str, record: dict[str, Any], device: torch.device) -> Ring:
    if payload == "cuda_ipc":
        return DeviceRing.open(record, device)
    return SlotRing.open(record)


def handshake(
    channel: Channel,
    payload: str,
    size: RingSize,
    label: str,
    who: str,
    timeout_s: float,
    *,
    initiator: bool,
    device: torch.device,
) -> Rings:
    """Agree with the peer on ``channel`` on the payload plane and map each
    other's ring (``size``: of the ring this side receives into; ``device``:
    where this side's rows are, the GPU of ``cuda_ipc`` rings), on the
    rendezvous connection before it carries frames.

    The attention rank is the ``initiator``: it sends work items, the FFN
    rank only answers them, so the FFN rank speaks last and no frame can
    follow a message of the handshake into the same read::

        attention                          ffn
        SETUP payload, host, ring   ──▶
                                    ◀──    SETUP payload, host, ring (it
                                           mapped the attention's)
        (maps the FFN's, unlinks its own)
        SETUP mapped                ──▶    (unlinks its own)
                                    ◀──    SETUP ready

    Raises:
        AFDConfigError: the two sides set ``payload`` otherwise, or are on
            other hosts with a slot plane (both named); ``cuda_ipc`` on a
            role that runs on the CPU.
        AFDTimeoutError: the peer said nothing in ``timeout_s``.
        AFDConnectorError: the peer's ring cannot be mapped.
    """
    deadline = time.monotonic() + timeout_s
    setup_type = MsgType.SETUP.value  # the control messages' own SETUP type
    mine = _make_ring(payload, size, label, device)

    def setup() -> dict[str, Any]:
        return {
            "type": setup_type,
            "payload": payload,
            "host": this_host(),
            "ring": mine.record() if mine else None,
        }

    def recv(what: str) -> dict[str, Any]:
        return channel.recv(deadline, f"{what} from {who}", timeout_s)

    rings = Rings(mine)
    try:
        if initiator:
            channel.send(setup())
            theirs = recv("the payload plane")
            _check_peer(theirs, payload, who)
            if payload in SLOT_PLANES:
                rings.theirs = _open_ring(payload, theirs["ring"], device)
            channel.send({"type": setup_type, "mapped": True})
            recv("the end of the payload handshake")
        else:
            theirs = recv("the payload plane")
            same_host = theirs.get("host") == this_host()
            if theirs.get("payload") == payload in SLOT_PLANES and same_host:
                rings.theirs = _open_ring(payload, theirs["ring"], device)
            channel.send(setup())
            _check_peer(theirs, payload, who)
            recv("the payload ring mapped")
            channel.send({"type": setup_type, "ready": True})
    finally:
        if mine is not None:
            mine.unlink()  # the peer holds it now, or never will
    return rings


def _check_peer(theirs: dict[str, Any], payload: str, who: str) -> None:
    if theirs.get("payload") != payload:
        raise AFDConfigError(
            f"the async connector's payload plane differs: {payload!r} here, "
            f"{theirs.get('payload')!r} on {who}; set the same connector option "
            "'payload' on every role"
        )
    if payload in SLOT_PLANES and theirs.get("host") != this_host():
        raise AFDConfigError(
            f"the async connector's payload {payload!r} needs every role on one "
            f"host: this one is {this_host()}, {who} is on {theirs.get('host')}; "
            "set payload 'socket'"
        )
