"""The ``cuda_ipc`` data plane: same-host CUDA tensors through shared buffers.

Each receiving endpoint allocates, at the handshake, one buffer per peer
(``ipc_layout``) and hands the peer its CUDA IPC handle in the SETUP record;
the peer opens it. A send moves the payload into the peer's buffer and then
stores a sequence number in the slot's flag: ``ipc_copy: ce`` is a
device-to-device copy on the current stream followed by
``ipc_kernels.signal_kernel``, ``sm`` one Triton kernel that does both
(``copy_signal_kernel``). A receive's wait spins on its own flag on the
device (``wait_kernel``) and then copies the payload out into the caller's
tensor. Everything is stream-ordered and
capturable in a CUDA graph; no host sync per layer.

Failures surface on the device: a wait ends after ``timeout_s`` (device
clock), at :meth:`abort`, or on a sequence number it did not expect, writes an
error record in pinned host memory and marks the endpoint failed, after which
its sends poison their flags so the peer fails in the same step. ``check``
(once per step, by the facade) turns the record into an exception.

Both roles on one GPU need MPS (``ipc_layout.check_pair``); across GPUs of one
host the IPC mapping uses peer access.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from vllm_afd.connector import ipc_layout as layout
from vllm_afd.connector.control import Rendezvous
from vllm_afd.connector.data import Capabilities, DataPlane, Work, check_backend
from vllm_afd.connector.protocol import LAYER_SHIFT, MAX_LAYERS, UBATCH_SHIFT, Kind
from vllm_afd.errors import (
    AFDConnectorError,
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


class _Recv(Work):
    __slots__ = ("_plane", "_peer", "_region", "_layer", "_dest")

    def __init__(self, plane: CudaIpcDataPlane, peer: int, region: layout.Region,
                 layer: int, dest: torch.Tensor) -> None:  # fmt: skip
        self._plane, self._peer, self._region = plane, peer, region
        self._layer, self._dest = layer, dest

    def wait(self, timeout_s: float) -> None:
        self._plane._wait(self._peer, self._region, self._layer, self._dest, timeout_s)


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
        self._local: list[torch.Tensor | None] = [None] * n  # we receive into
        self._local_layout: list[layout.Layout | None] = [None] * n
        self._remote: list[torch.Tensor | None] = [None] * n  # we write into
        self._remote_layout: list[layout.Layout | None] = [None] * n
        slots = layout.KINDS * 8
        # [peer, 0 = sent / 1 = seen, slot]
        self._seq = torch.zeros((n, 2, slots), dtype=torch.int64, device=device)
        self._failed = torch.zeros(1, dtype=torch.int64, device=device)
        # sm copy: how many programs of a send finished ([peer, slot])
        self._tickets = torch.zeros((n, slots), dtype=torch.int32, device=device)
        self._record = torch.zeros(4, dtype=torch.int64, pin_memory=True)
        self._abort = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self._record_arg, self._abort_arg = _Pinned(self._record), _Pinned(self._abort)
        self._flags: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._pending_open: dict[int, dict[str, Any]] = {}  # ffn: peers' buffers
        self._reported = False
        self._closed = False
        from vllm_afd.connector import ipc_kernels

        self._k = ipc_kernels

    # ------------------------------------------------------------ handshake
    def _alloc(self, i: int, lay: layout.Layout) -> dict[str, Any]:
        # torch.zeros: every flag starts at 0 (nothing sent yet)
        buf = torch.zeros(lay.nbytes, dtype=torch.uint8, device=self._device)
        self._local[i], self._local_layout[i] = buf, lay
        return share(buf)

    def setup(self, peer: int, theirs: Mapping[str, Any] | None) -> dict[str, Any]:
        if self._role is AFDRole.ATTENTION:
            lay = layout.attention_layout(self._shapes)
            rec = self._alloc(peer, lay)
            self._remote_layout[peer] = layout.ffn_layout(self._shapes)
            return layout.Offer(self._shapes, self._place, rec).to_wire()
        assert theirs is not None
        check_backend(self.backend, theirs)
        offer = layout.Offer.from_wire(dict(theirs))
        who = f"attention peer {peer} and this ffn rank"
        layout.check_shapes(self._shapes, offer.shapes, who)
        layout.check_pair(self._place, offer.place, who, self._allow_slicing)
        rec = self._alloc(peer, layout.ffn_layout(offer.shapes))
        self._remote_layout[peer] = layout.attention_layout(offer.shapes)
        self._pending_open[peer] = offer.buffer
        return layout.Answer(self._place, rec).to_wire()

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
                record = answer.buffer
            else:
                record = self._pending_open[i]
            remote = open_shared(record, self._device)
            lay = self._remote_layout[i]
            assert lay is not None
            if remote.numel() < lay.nbytes:
                raise AFDProtocolError(
                    f"the peer's cuda_ipc buffer holds {remote.numel()} bytes, "
                    f"{lay.nbytes} expected"
                )
            self._remote[i] = remote
        sizes = [f"{b.numel() / 2**20:.1f} MiB" for b in self._local if b is not None]
        logger.info(
            "AFD cuda_ipc data plane: %d peer buffer(s) of %s, max_tokens=%d, "
            "gpu %s, MPS %s", len(self._peers), ", ".join(sizes),
            self._shapes.max_tokens, self._place.gpu,
            "on" if self._place.mps else "off",
        )  # fmt: skip

    # ------------------------------------------------------------- transfers
    def _slot(self, tag: int) -> tuple[int, int, int]:
        """(kind, ubatch, layer) of an exchange tag."""
        return (
            tag & _KIND_MASK,
            (tag >> UBATCH_SHIFT) & _UBATCH_MASK,
            (tag >> LAYER_SHIFT) & (MAX_LAYERS - 1),
        )

    def _flag_views(self, i: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(remote flag, local flag) of peer ``i``'s ``slot`` as int64 views."""
        views = self._flags.get((i, slot))
        if views is None:
            remote, local = self._remote[i], self._local[i]
            assert remote is not None and local is not None
            n = layout.FLAG_BYTES * layout.KINDS * 8
            views = (
                remote[:n].view(torch.int64)[slot : slot + 1],
                local[:n].view(torch.int64)[slot : slot + 1],
            )
            self._flags[(i, slot)] = views
        return views

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        i = self._index[peer]
        kind, ubatch, layer = self._slot(tag)
        lay, remote = self._remote_layout[i], self._remote[i]
        if remote is None or lay is None:
            raise AFDConnectorError("the cuda_ipc data plane is not started or closed")
        region = lay.region(kind, ubatch)
        src = tensor.view(-1).view(torch.uint8)
        n = src.numel()
        if n > region.nbytes:
            raise AFDConnectorError(
                f"{Kind(kind).name.lower()} of {n} bytes exceeds the {region.nbytes}"
                f"-byte cuda_ipc buffer sized at the handshake (max_tokens="
                f"{self._shapes.max_tokens}); the step has more tokens than vLLM's "
                "max_num_batched_tokens"
            )
        dst = remote[region.offset : region.offset + n]
        flag, _ = self._flag_views(i, region.slot)
        if self._sm_copy:
            self._copy_signal(src, dst, flag, i, region.slot, layer)
            return _DONE
        dst.copy_(src)
        self._k.signal_kernel[(1,)](
            flag, self._seq[i, 0, region.slot:region.slot + 1], self._failed,
            layer, POISON_BIT=self._k.POISON, SEQ_SHIFT=self._k.SEQ_SHIFT,
        )  # fmt: skip
        return _DONE

    def _copy_signal(self, src: torch.Tensor, dst: torch.Tensor, flag: torch.Tensor,
                     i: int, slot: int, layer: int) -> None:  # fmt: skip
        if src.numel() % 4 == 0 and src.data_ptr() % 4 == 0:
            src, dst = src.view(torch.int32), dst.view(torch.int32)
        n = src.numel()
        self._k.copy_signal_kernel[(max(1, -(-n // _SM_BLOCK)),)](
            src, dst, n, flag, self._seq[i, 0, slot : slot + 1], self._failed,
            self._tickets[i, slot : slot + 1], layer, BLOCK=_SM_BLOCK,
            POISON_BIT=self._k.POISON, SEQ_SHIFT=self._k.SEQ_SHIFT,
        )  # fmt: skip

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        i = self._index[peer]
        kind, ubatch, layer = self._slot(tag)
        lay = self._local_layout[i]
        if lay is None or self._local[i] is None:
            raise AFDConnectorError("the cuda_ipc data plane is not started or closed")
        return _Recv(self, i, lay.region(kind, ubatch), layer, tensor)

    def _wait(self, i: int, region: layout.Region, layer: int,
              dest: torch.Tensor, timeout_s: float) -> None:  # fmt: skip
        local = self._local[i]
        if local is None:
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
        _, flag = self._flag_views(i, region.slot)
        self._k.wait_kernel[(1,)](
            flag, self._seq[i, 1, region.slot:region.slot + 1], self._failed,
            self._record_arg, self._abort_arg, timeout_ns, region.slot, layer,
            POISON_BIT=self._k.POISON, SEQ_SHIFT=self._k.SEQ_SHIFT,
            ABORT_EVERY=_ABORT_EVERY,
        )  # fmt: skip
        out.copy_(local[region.offset : region.offset + n])

    # ---------------------------------------------------------------- errors
    def check(self) -> None:
        code = int(self._record[0])
        if code == 0 or self._reported:
            return
        self._reported = True
        slot, got, want = (int(x) for x in self._record[1:4])
        k = self._k
        kind = Kind(slot % layout.KINDS).name.lower()
        what = f"{kind} ubatch {slot // layout.KINDS}"

        def exchange(flag: int) -> str:
            flag &= ~k.POISON
            n, layer = flag >> k.SEQ_SHIFT, flag & (MAX_LAYERS - 1)
            return f"#{n} (layer {layer})"

        if code == k.TIMEOUT:
            raise AFDTimeoutError(
                f"the device waited for {what} exchange {exchange(want)} and it "
                "never came (timeout_s on the device clock)"
            )
        if code == k.ABORTED:
            raise AFDPeerError(f"the wait for {what} was aborted (the peer is gone)")
        if code == k.POISONED:
            raise AFDPeerError(
                f"the peer failed an exchange of this step and said so with {what}"
            )
        raise AFDProtocolError(
            f"{what}: the device expected exchange {exchange(want)} and found "
            f"{exchange(got)}: the endpoints ran different exchanges "
            "(desynchronised)"
        )

    def abort(self) -> None:
        self._abort[0] = 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.abort()  # any wait still spinning ends now
        self._remote = [None] * len(self._peers)
        self._flags.clear()
