"""Frames of the ``async`` connector: work items and their replies.

After the rendezvous every attention rank keeps one TCP connection to every
FFN rank (``Topology(all_to_all=True)``) and both sides switch it to these
binary frames. A frame is a fixed header, the per-expert counts and the
payload::

    header (32 bytes, big-endian)
      magic    4s   b"AFDw"
      kind     u8   WORK (attention -> ffn), REPLY (ffn -> attention),
                    SHUTDOWN (either way; payload: the reason, UTF-8);
                    | IN_SLOT (0x80): the payload is in the receiver's
                    slot ring at ``seq`` (``payload: shared`` or
                    ``cuda_ipc``, ``async_slots``), not on the connection
      dtype    u8   activation dtype code (float32, bfloat16, float16)
      layer    u16  decoder layer
      seq      u32  the sender's work-item counter on this connection; a
                    REPLY echoes its WORK's
      tokens   u32  T, rows of the item
      cols     u32  columns of the activation tensor: H (WORK), C (REPLY)
      top_k    u16  K (WORK), 0 (REPLY)
      counts   u16  number of u32 per-expert counts that follow
      nbytes   u64  payload bytes
    counts   u32 x counts   WORK: rows routed to each of the FFN rank's
                            local experts, in expert order
    payload
      WORK     hidden [T, H] dtype | topk_ids [T, K] int32 |
               topk_weights [T, K] float32
      REPLY    out [T, C] dtype

A frame IN_SLOT is its header and counts alone on the connection.

There is no step plan: the header says everything the FFN rank needs, and
the sender is the connection a frame arrives on. Frames on one connection
are in order (TCP), so a REPLY answers the oldest WORK not yet answered.

This module imports torch but not vLLM.
"""

from __future__ import annotations

import enum
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_afd.errors import AFDPeerError, AFDProtocolError

MAGIC = b"AFDw"
HEADER = struct.Struct(">4sBBHIIIHHQ")
_COUNT = struct.Struct(">I")
#: the largest payload a frame may announce (a sanity bound: 16 GiB)
MAX_PAYLOAD = 1 << 34
#: the kind's flag of a frame whose payload is in the receiver's slot ring
IN_SLOT = 0x80


class FrameKind(enum.IntEnum):
    WORK = 1
    REPLY = 2
    SHUTDOWN = 3


DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


def dtype_code(dtype: torch.dtype) -> int:
    """The header's code of ``dtype``.

    Raises:
        AFDProtocolError: not an activation dtype the frames carry.
    """
    try:
        return DTYPES.index(dtype)
    except ValueError:
        raise AFDProtocolError(
            f"the async connector carries {', '.join(map(str, DTYPES))} "
            f"activations, not {dtype}"
        ) from None


@dataclass
class Frame:
    """One received frame; tensors are views of its own payload buffer."""

    kind: FrameKind
    dtype: torch.dtype
    layer: int
    seq: int
    tokens: int
    cols: int
    top_k: int
    counts: tuple[int, ...]
    payload: torch.Tensor  # uint8 [nbytes]
    #: the payload is a view of the receiver's slot ring (valid until the
    #: slot is written again, ``async_slots``)
    in_slot: bool = False

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """WORK: (hidden, topk_ids, topk_weights); REPLY: (out,)."""
        t, h, k = self.tokens, self.cols, self.top_k
        item = self.dtype.itemsize
        act = self.payload[: t * h * item].view(self.dtype).view(t, h)
        if self.kind is FrameKind.REPLY:
            return (act,)
        at = t * h * item
        ids = self.payload[at : at + t * k * 4].view(torch.int32).view(t, k)
        at += t * k * 4
        weights = self.payload[at : at + t * k * 4].view(torch.float32).view(t, k)
        return act, ids, weights

    @property
    def reason(self) -> str:
        return bytes(self.payload.numpy()).decode(errors="replace")


def encode_header(
    kind: FrameKind,
    *,
    dtype: torch.dtype = torch.float32,
    layer: int = 0,
    seq: int = 0,
    tokens: int = 0,
    cols: int = 0,
    top_k: int = 0,
    counts: tuple[int, ...] = (),
    nbytes: int = 0,
    in_slot: bool = False,
) -> bytes:
    """The header and counts of one frame (its payload follows, unless
    ``in_slot``: then it is in the receiver's slot of ``seq``)."""
    head = HEADER.pack(
        MAGIC, int(kind) | (IN_SLOT if in_slot else 0), dtype_code(dtype), layer,
        seq & 0xFFFFFFFF, tokens, cols, top_k, len(counts), nbytes,
    )  # fmt: skip
    return head + b"".join(_COUNT.pack(c) for c in counts)


def payload_bytes(*tensors: torch.Tensor) -> list[memoryview]:
    """Zero-copy byte views of contiguous CPU tensors, for ``send``."""
    return [
        memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")
        for t in tensors
        if t.numel()
    ]


def fresh_buffer(nbytes: int) -> torch.Tensor:
    """A new ``[nbytes]`` uint8 CPU tensor: a frame's own payload buffer."""
    return torch.empty(nbytes, dtype=torch.uint8)


class FrameReader:
    """Reassembles frames from a non-blocking socket, one state machine per
    connection: header, counts, then the payload straight into its buffer.

    Attributes:
        buffer_for: gives the ``[nbytes]`` uint8 CPU tensor a frame's payload
            is read into, when its header is whole (default: a fresh one per
            frame; a reader whose frames are done with before the next one
            may hand out a kept buffer).
        slot_for: ``(seq, nbytes)`` -> the view of this side's slot ring a
            frame IN_SLOT carries its payload in; None: the connection has
            no slot ring (``payload: socket``).
    """

    def __init__(self, sock: socket.socket, peer: str, pending: bytes = b"") -> None:
        self.sock, self.peer = sock, peer
        self.eof = False
        self.buffer_for: Callable[[int], torch.Tensor] = fresh_buffer
        self.slot_for: Callable[[int, int], torch.Tensor] | None = None
        self._buf = bytearray(pending)
        self._head: tuple | None = None
        self._counts: tuple[int, ...] = ()
        self._payload: torch.Tensor | None = None
        self._view: memoryview | None = None
        self._filled = 0

    def read(self, limit: int | None = None) -> list[Frame]:
        """Every frame completed by what the socket holds now (never blocks),
        at most ``limit`` of them (the bytes of later frames stay buffered or
        in the socket for the next call). Sets :attr:`eof` when the peer
        closed its side."""
        frames: list[Frame] = []
        while limit is None or len(frames) < limit:
            frame = self._advance()
            if frame is not None:
                frames.append(frame)
                continue
            if self.eof or not self._recv():
                break
        return frames

    def _recv(self) -> bool:
        """Read once from the socket; False when nothing more is there."""
        try:
            if self._view is not None and not self._buf:
                n = self.sock.recv_into(self._view[self._filled :])
                if n == 0:
                    self.eof = True
                    return False
                self._filled += n
                return True
            chunk = self.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            chunk = b""
        if not chunk:
            self.eof = True
            return False
        self._buf += chunk
        return True

    def _advance(self) -> Frame | None:
        """Move buffered bytes into the frame being read; the frame once whole."""
        if self._head is None:
            if len(self._buf) < HEADER.size:
                return None
            head = HEADER.unpack_from(self._buf)
            if head[0] != MAGIC:
                raise AFDProtocolError(
                    f"{self.peer} sent a frame without the async connector's "
                    f"magic ({bytes(self._buf[:8])!r}): it runs another protocol"
                )
            n_counts, nbytes = head[8], head[9]
            if len(self._buf) < HEADER.size + 4 * n_counts:
                return None
            kind = head[1] & ~IN_SLOT
            if nbytes > MAX_PAYLOAD or kind not in FrameKind._value2member_map_:
                raise AFDProtocolError(f"{self.peer} sent a malformed frame {head!r}")
            self._counts = tuple(
                _COUNT.unpack_from(self._buf, HEADER.size + 4 * i)[0]
                for i in range(n_counts)
            )
            del self._buf[: HEADER.size + 4 * n_counts]
            if head[1] & IN_SLOT:
                return self._in_slot(head)
            self._head = head
            self._payload = self.buffer_for(nbytes)
            self._view = memoryview(self._payload.numpy()).cast("B")
            self._filled = 0
        assert self._view is not None and self._payload is not None
        if self._buf:
            take = min(len(self._buf), len(self._view) - self._filled)
            self._view[self._filled : self._filled + take] = self._buf[:take]
            del self._buf[:take]
            self._filled += take
        if self._filled < len(self._view):
            return None
        head, payload = self._head, self._payload
        self._head = self._payload = self._view = None
        _, kind, code, layer, seq, tokens, cols, top_k, _, _ = head
        if code >= len(DTYPES):
            raise AFDProtocolError(f"{self.peer} sent unknown dtype code {code}")
        return Frame(
            FrameKind(kind), DTYPES[code], layer, seq, tokens, cols, top_k,
            self._counts, payload,
        )  # fmt: skip

    def _in_slot(self, head: tuple) -> Frame:
        """The frame of ``head``, whose payload is in this side's slot ring."""
        _, kind, code, layer, seq, tokens, cols, top_k, _, nbytes = head
        if self.slot_for is None:
            raise AFDProtocolError(
                f"{self.peer} sent a payload in a slot ring, but this connection "
                "has none (the roles disagree on the connector option 'payload')"
            )
        if code >= len(DTYPES):
            raise AFDProtocolError(f"{self.peer} sent unknown dtype code {code}")
        return Frame(
            FrameKind(kind & ~IN_SLOT), DTYPES[code], layer, seq, tokens, cols,
            top_k, self._counts, self.slot_for(seq, nbytes), in_slot=True,
        )  # fmt: skip


def send_all(
    sock: socket.socket, parts: list[bytes | memoryview], deadline: float, peer: str
) -> int:
    """Write ``parts`` on the non-blocking ``sock`` by ``deadline``
    (monotonic); returns the bytes sent.

    Raises:
        AFDPeerError: the connection is gone, or the peer read nothing until
            the deadline (hung or stopped).
    """
    import select
    import time

    sent = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while view:
            try:
                n = sock.send(view)
            except (BlockingIOError, InterruptedError):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AFDPeerError(
                        f"{peer} read nothing of a frame in time (hung or stopped)"
                    ) from None
                select.select([], [sock], [], remaining)
                continue
            except OSError as e:
                raise AFDPeerError(f"{peer} is unreachable ({e})") from None
            view = view[n:]
            sent += n
    return sent
