"""The ``cuda_ipc`` data plane: same-host CUDA tensors through shared buffers.

Each attention rank owns one buffer per FFN peer (``ipc_layout.pair_layout``)
and hands the FFN rank its CUDA IPC handle in the SETUP record; the FFN rank
opens it. Both directions live in that buffer: a send moves the payload into
its region and then stores a sequence number in the slot's flag (``ipc_copy:
ce`` a device-to-device copy followed by ``ipc_kernels.signal_kernel``, ``sm``
one Triton kernel that does both); a receive spins on the slot's flag on the
device (``wait_kernel``, one program) and then copies the payload out into
the caller's tensor.
Everything is stream-ordered and capturable in a CUDA graph; no host sync per
layer.

Failures surface on the device: a wait ends after ``timeout_s`` (device
clock), at :meth:`abort`, or on a sequence number it did not expect, writes an
error record in pinned host memory and marks the endpoint failed, after which
its sends poison their flags so the peer fails in the same step. ``check``
(once per step, by the facade) turns the record into an exception.

An FFN rank that dies and comes back (``worker.ffn_link``): the attention
rank's buffers, counters and error words are kept for the life of the
process (:class:`_Kept`), so the CUDA graphs it captured, which point at
them, stay valid; the next plane of that process reuses them and
:meth:`CudaIpcDataPlane.resume` zeroes them while no step runs.

Both roles on one GPU need MPS (``ipc_layout.check_pair``); across GPUs of one
host the IPC mapping uses peer access.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from vllm_afd.connector import ipc_layout as layout
from vllm_afd.connector.control import Rendezvous
from vllm_afd.connector.data import Capabilities, DataPlane, Work, check_backend
from vllm_afd.connector.protocol import LAYER_SHIFT, MAX_LAYERS, UBATCH_SHIFT, Kind
from vllm_afd.errors import (
    AFDConnectorError,
    AFDError,
    AFDPeerError,
    AFDProtocolError,
    AFDTimeoutError,
)
from vllm_afd.roles import AFDRole

logger = logging.getLogger(__name__)
_KIND_MASK = (1 << UBATCH_SHIFT) - 1
_UBATCH_MASK = 0b111
#: spins between two reads of the abort word (host memory)
_ABORT_EVERY = 256
#: the shortest device-side wait (see CudaIpcDataPlane._wait)
_MIN_TIMEOUT_NS = 1 << 31
#: elements (int32, or bytes) one program of the sm copy moves
_SM_BLOCK = 2048
#: a wait's error record holds ``peer index * _PEER_STRIDE + slot``
_PEER_STRIDE = 1 << 16
#: how long an FFN plane's close waits for its stream to drain after the abort
_CLOSE_REPORT_S = 2.0


def share(buf: torch.Tensor) -> dict[str, Any]:
    """The IPC record of CUDA tensor ``buf``'s storage (JSON-able)."""
    (dev, handle, size, offset, ref, ref_off, event, sync) = (
        buf.untyped_storage()._share_cuda_()
    )
    return {
        "handle": handle.hex(),
        "size": size,
        "offset": offset,
        "ref": ref.hex(),
        "ref_offset": ref_off,
        "event": event.hex() if event else "",
        "event_sync": bool(sync),
        "nbytes": buf.numel(),
    }


def open_shared(record: Mapping[str, Any], device: torch.device) -> torch.Tensor:
    """The peer's buffer of :func:`share`'s ``record`` as a uint8 tensor here."""
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index if device.index is not None else torch.cuda.current_device(),
            bytes.fromhex(record["handle"]),
            int(record["size"]),
            int(record["offset"]),
            bytes.fromhex(record["ref"]),
            int(record["ref_offset"]),
            bytes.fromhex(record["event"]),
            bool(record["event_sync"]),
        )
    except (KeyError, ValueError, TypeError) as e:
        raise AFDProtocolError(f"unreadable cuda_ipc buffer record: {e!r}") from None
    except RuntimeError as e:
        raise AFDConnectorError(
            f"cannot open the peer's cuda_ipc buffer on {device}: {e}. Both ends "
            "must be on one host with peer access between their GPUs; otherwise "
            "use backend 'nccl'"
        ) from None
    t = torch.empty(0, dtype=torch.uint8, device=device)
    t.set_(storage, 0, (int(record["nbytes"]),), (1,))
    return t


class _Pinned:
    """A pinned host tensor as a Triton pointer argument (the device reaches
    pinned memory at the same address under unified addressing)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()


class _Done(Work):
    def wait(self, timeout_s: float) -> None:
        return None


_DONE = _Done()


def _words(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte views as int32 where both allow it (four times fewer elements)."""
    if src.numel() % 4 == 0 and src.data_ptr() % 4 == 0 and dst.data_ptr() % 4 == 0:
        return src.view(torch.int32), dst.view(torch.int32)
    return src, dst


class _Recv(Work):
    __slots__ = ("_plane", "_peer", "_region", "_layer", "_dest")

    def __init__(self, plane: CudaIpcDataPlane, peer: int, region: layout.Region,
                 layer: int, dest: torch.Tensor) -> None:  # fmt: skip
        self._plane, self._peer, self._region = plane, peer, region
        self._layer, self._dest = layer, dest

    def wait(self, timeout_s: float) -> None:
        self._plane._wait(self._peer, self._region, self._layer, self._dest, timeout_s)


class _Kept:
    """What an attention rank's CUDA graphs point at: one per process and
    (device, peers, layout), reused by every plane after the first."""

    def __init__(
        self, device: torch.device, peers: int, lay: layout.Layout | None
    ) -> None:
        # torch.zeros: every flag starts at 0 (nothing sent yet)
        self.buffers = (
            []
            if lay is None
            else [
                torch.zeros(lay.nbytes, dtype=torch.uint8, device=device)
                for _ in range(peers)
            ]
        )
        self.busy = True  # a plane uses it
        slots = layout.KINDS * 8
        # [peer, 0 = sent / 1 = seen, slot]
        self.seq = torch.zeros((peers, 2, slots), dtype=torch.int64, device=device)
        self.failed = torch.zeros(1, dtype=torch.int64, device=device)
        # sm copies: how many programs of a send finished
        self.tickets = torch.zeros((peers, slots), dtype=torch.int32, device=device)
        self.record = torch.zeros(4, dtype=torch.int64, pin_memory=True)
        self.abort = torch.zeros(1, dtype=torch.int32, pin_memory=True)

    def reset(self, flag_bytes: int) -> None:
        """Everything back to 'nothing exchanged yet' (no step may run)."""
        for buf in self.buffers:
            buf[:flag_bytes].zero_()
        self.seq.zero_()
        self.failed.zero_()
        self.tickets.zero_()
        self.record.zero_()


_KEPT: dict[tuple[Any, ...], list[_Kept]] = {}
_KEPT_LOCK = threading.Lock()


def _kept_for(
    device: torch.device, peers: tuple[int, ...], lay: layout.Layout
) -> _Kept:
    """A kept set no open plane uses (made on first need). A reused set
    stays aborted, as its last plane left it, until :meth:`resume`: graph
    replays of the lost session may still run on it."""
    with _KEPT_LOCK:
        sets = _KEPT.setdefault((str(device), peers, lay), [])
        for kept in sets:
            if not kept.busy:
                kept.busy = True
                return kept
        kept = _Kept(device, len(peers), lay)
        sets.append(kept)
        return kept


class CudaIpcDataPlane(DataPlane):
    """Shared-buffer moves between endpoints of one host."""

    backend = "cuda_ipc"
    capabilities = Capabilities(
        graph_capturable=True, matches_tags=True, bounded_wait=True
    )

    def __init__(
        self,
        *,
        role: AFDRole,
        peers: tuple[int, ...],
        device: torch.device,
        shapes: layout.Shapes,
        timeout_s: float,
        allow_time_slicing: bool = False,
        copy: str = "ce",
    ) -> None:
        if device.type != "cuda":
            raise AFDConnectorError(
                "backend 'cuda_ipc' moves cuda tensors, the connector device "
                f"is {device}"
            )
        self._role, self._peers, self._device = role, peers, device
        self._index = {g: i for i, g in enumerate(peers)}
        self._shapes = shapes  # attention: its own; ffn: filled per peer at setup
        self._timeout_ns = int(timeout_s * 1e9)
        self._allow_slicing = allow_time_slicing
        self._sm_copy = copy == "sm"
        self._place = layout.Place(
            layout.this_host(),
            str(torch.cuda.get_device_properties(device).uuid),
            layout.mps_active(),
        )
        n = len(peers)
        # the pair buffers: attention's own, or the attention peers' (ffn)
        self._buf: list[torch.Tensor | None] = [None] * n
        self._layout: list[layout.Layout | None] = [None] * n
        if role is AFDRole.ATTENTION:
            lay = layout.pair_layout(shapes)
            kept = _kept_for(device, peers, lay)
            self._layout = [lay] * n
        else:
            kept = _Kept(device, n, None)
        self._kept = kept
        self._seq, self._failed, self._tickets = kept.seq, kept.failed, kept.tickets
        self._record, self._abort = kept.record, kept.abort
        self._record_arg, self._abort_arg = _Pinned(self._record), _Pinned(self._abort)
        self._flags: dict[tuple[int, int], torch.Tensor] = {}
        self._offers: dict[int, dict[str, Any]] = {}  # ffn: peers' buffers
        self._reported = False
        self._closed = False
        from vllm_afd.connector import ipc_kernels

        self._k = ipc_kernels

    # ------------------------------------------------------------ handshake
    def setup(self, peer: int, theirs: Mapping[str, Any] | None) -> dict[str, Any]:
        if self._role is AFDRole.ATTENTION:
            buf = self._kept.buffers[peer]
            return layout.Offer(self._shapes, self._place, share(buf)).to_wire()
        assert theirs is not None
        check_backend(self.backend, theirs)
        offer = layout.Offer.from_wire(dict(theirs))
        who = f"attention peer {peer} and this ffn rank"
        layout.check_shapes(self._shapes, offer.shapes, who)
        layout.check_pair(self._place, offer.place, who, self._allow_slicing)
        self._layout[peer] = layout.pair_layout(offer.shapes)
        self._offers[peer] = offer.buffer
        return layout.Answer(self._place).to_wire()

    def start(self, rendezvous: Rendezvous) -> None:
        if len(rendezvous.peer_blobs) != len(self._peers):
            raise AFDProtocolError(
                f"cuda_ipc got {len(rendezvous.peer_blobs)} setup records for "
                f"{len(self._peers)} peers"
            )
        for i, blob in enumerate(rendezvous.peer_blobs):
            if self._role is AFDRole.ATTENTION:
                answer = layout.Answer.from_wire(dict(blob))
                layout.check_pair(self._place, answer.place, "this attention rank "
                                  "and its ffn rank", self._allow_slicing)  # fmt: skip
                self._buf[i] = self._kept.buffers[i]
                continue
            buf = open_shared(self._offers[i], self._device)
            lay = self._layout[i]
            assert lay is not None
            if buf.numel() < lay.nbytes:
                raise AFDProtocolError(
                    f"the attention peer's cuda_ipc buffer holds {buf.numel()} "
                    f"bytes, {lay.nbytes} expected"
                )
            self._buf[i] = buf
        sizes = [f"{b.numel() / 2**20:.1f} MiB" for b in self._buf if b is not None]
        logger.info(
            "AFD cuda_ipc data plane: %d pair buffer(s) of %s, max_tokens=%d, "
            "gpu %s, MPS %s, %s copies", len(self._peers), ", ".join(sizes),
            self._shapes.max_tokens, self._place.gpu,
            "on" if self._place.mps else "off", "sm" if self._sm_copy else "ce",
        )  # fmt: skip

    def resume(self) -> None:
        """Zero the kept counters, flags and error words, and clear the
        abort word, once the device finished every step of the last plane;
        the caller runs no step meanwhile (``worker.ffn_link``)."""
        torch.cuda.synchronize(self._device)
        self._kept.reset(self._flag_bytes())
        torch.cuda.synchronize(self._device)
        self._abort[0] = 0

    # ------------------------------------------------------------- transfers
    def _slot(self, tag: int) -> tuple[int, int, int]:
        """(kind, ubatch, layer) of an exchange tag."""
        return (
            tag & _KIND_MASK,
            (tag >> UBATCH_SHIFT) & _UBATCH_MASK,
            (tag >> LAYER_SHIFT) & (MAX_LAYERS - 1),
        )

    def _flag_bytes(self) -> int:
        return layout.FLAG_BYTES * layout.KINDS * 8

    def _flag(self, i: int, slot: int) -> torch.Tensor:
        """Peer ``i``'s ``slot`` flag as an int64 view of the pair buffer."""
        flag = self._flags.get((i, slot))
        if flag is None:
            buf = self._buf[i]
            assert buf is not None
            flag = buf[: self._flag_bytes()].view(torch.int64)[slot : slot + 1]
            self._flags[(i, slot)] = flag
        return flag

    def _region(self, peer: int, tag: int) -> tuple[int, layout.Region, int]:
        """(peer index, region, layer) of an exchange with ``peer``."""
        i = self._index[peer]
        kind, ubatch, layer = self._slot(tag)
        lay = self._layout[i]
        if self._buf[i] is None or lay is None:
            raise AFDConnectorError("the cuda_ipc data plane is not started or closed")
        return i, lay.region(kind, ubatch), layer

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        i, region, layer = self._region(peer, tag)
        src = tensor.view(-1).view(torch.uint8)
        n = src.numel()
        if n > region.nbytes:
            raise AFDConnectorError(
                f"{region.kind.name.lower()} of {n} bytes exceeds the "
                f"{region.nbytes}-byte cuda_ipc buffer sized at the handshake "
                f"(max_tokens={self._shapes.max_tokens}); the step has more "
                "tokens than vLLM's max_num_batched_tokens"
            )
        buf = self._buf[i]
        assert buf is not None
        dst = buf[region.offset : region.offset + n]
        flag = self._flag(i, region.slot)
        sent = self._seq[i, 0, region.slot : region.slot + 1]
        if self._sm_copy:
            src, dst = _words(src, dst)
            n = src.numel()
            self._k.copy_signal_kernel[(max(1, -(-n // _SM_BLOCK)),)](
                src, dst, n, flag, sent, self._failed,
                self._tickets[i, region.slot : region.slot + 1], layer,
                BLOCK=_SM_BLOCK, POISON_BIT=self._k.POISON,
                SEQ_SHIFT=self._k.SEQ_SHIFT,
            )  # fmt: skip
            return _DONE
        dst.copy_(src)
        self._k.signal_kernel[(1,)](
            flag, sent, self._failed, layer, POISON_BIT=self._k.POISON,
            SEQ_SHIFT=self._k.SEQ_SHIFT,
        )  # fmt: skip
        return _DONE

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        i, region, layer = self._region(peer, tag)
        return _Recv(self, i, region, layer, tensor)

    def _wait(self, i: int, region: layout.Region, layer: int,
              dest: torch.Tensor, timeout_s: float) -> None:  # fmt: skip
        buf = self._buf[i]
        if buf is None:
            raise AFDConnectorError("the cuda_ipc data plane is closed")
        out = dest.view(-1).view(torch.uint8)
        n = out.numel()
        if n > region.nbytes:  # before the wait counts the exchange
            raise AFDConnectorError(
                f"a receive of {n} bytes exceeds the {region.nbytes}-byte cuda_ipc "
                "buffer sized at the handshake"
            )
        # A replay runs long after capture: it waits timeout_s, not the
        # warm-up limit the capture step was planned with.
        capturing = torch.cuda.is_current_stream_capturing()
        timeout_ns = self._timeout_ns if capturing else int(timeout_s * 1e9)
        # At least 2^31 ns (2.1 s): an int64 argument in every call. Triton
        # compiles one kernel per argument type, and a graph capture must not
        # meet a kernel its eager warm-up did not compile.
        timeout_ns = max(timeout_ns, _MIN_TIMEOUT_NS)
        flag = self._flag(i, region.slot)
        seen = self._seq[i, 1, region.slot : region.slot + 1]
        k = self._k
        k.wait_kernel[(1,)](
            flag, seen, self._failed, self._record_arg, self._abort_arg,
            timeout_ns, i * _PEER_STRIDE + region.slot, layer, POISON_BIT=k.POISON,
            SEQ_SHIFT=k.SEQ_SHIFT, ABORT_EVERY=_ABORT_EVERY,
        )  # fmt: skip
        out.copy_(buf[region.offset : region.offset + n])

    # ---------------------------------------------------------------- errors
    def check(self) -> None:
        code = int(self._record[0])
        if code == 0 or self._reported:
            return
        self._reported = True
        where, got, want = (int(x) for x in self._record[1:4])
        i, slot = divmod(where, _PEER_STRIDE)
        k = self._k
        kind = Kind(slot % layout.KINDS).name.lower()
        peer = "ffn" if self._role is AFDRole.ATTENTION else "attention"
        if i < len(self._peers):
            peer = f"{peer} rank {self._peers[i]}"
        what = f"{kind} ubatch {slot // layout.KINDS}"

        def exchange(flag: int) -> str:
            flag &= ~k.POISON
            n, layer = flag >> k.SEQ_SHIFT, flag & (MAX_LAYERS - 1)
            return f"#{n} (layer {layer})"

        # What the slot held when the wait gave up tells a peer that sent
        # nothing (the exchange before, or none) from one whose counter ran
        # apart from this endpoint's.
        last = f"exchange {exchange(got)}" if got else "no exchange yet"
        if code == k.TIMEOUT:
            raise AFDTimeoutError(
                f"the device waited for {what} exchange {exchange(want)} from "
                f"{peer} and it never came (timeout_s on the device clock); the "
                f"slot held {last}"
            )
        if code == k.ABORTED:
            raise AFDPeerError(
                f"the wait for {what} exchange {exchange(want)} from {peer} was "
                f"aborted (the peer is gone); the slot held {last}"
            )
        if code == k.POISONED:
            raise AFDPeerError(
                f"the peer failed an exchange of this step and said so with {what} "
                f"({peer})"
            )
        raise AFDProtocolError(
            f"{what} from {peer}: the device expected exchange "
            f"{exchange(want)} and found {exchange(got)}: the endpoints ran "
            "different exchanges "
            "(desynchronised)"
        )

    def abort(self) -> None:
        self._abort[0] = 1

    def _report_device_state(self) -> None:
        """Log where the FFN's device stood when its plane closed: a wait
        that was still spinning (the abort ends it and leaves its record:
        which peer and exchange, what the slot held), or a stream still busy
        after the abort (stuck outside this plane's waits). Silent when the
        device had finished (a clean close) or the record was reported."""
        if self._reported:
            return
        stream = torch.cuda.default_stream(self._device)
        try:
            deadline = time.monotonic() + _CLOSE_REPORT_S
            while not stream.query() and time.monotonic() < deadline:
                time.sleep(0.01)
            busy = not stream.query()
        except RuntimeError as e:  # a device in error: nothing more to read
            logger.warning("AFD cuda_ipc data plane closed; the device: %s", e)
            return
        try:
            self.check()
        except AFDError as e:
            logger.warning("AFD cuda_ipc data plane closed mid-exchange: %s", e)
            return
        if busy:
            logger.warning(
                "AFD cuda_ipc data plane closed with the device's default stream "
                "still busy %.0f s after the abort, in no wait of this plane "
                "(a kernel of the step, or another wait)", _CLOSE_REPORT_S,
            )  # fmt: skip

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.abort()  # any wait still spinning ends now
        if self._role is AFDRole.FFN:
            self._report_device_state()
        self._buf = [None] * len(self._peers)  # attention: _KEPT keeps its own
        self._flags.clear()
        with _KEPT_LOCK:
            self._kept.busy = False  # the next plane of this process takes it
