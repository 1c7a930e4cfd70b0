"""The ``async`` connector: expert-parallel work items, no step plans.

Each FFN rank owns a contiguous slice of the routed experts
(:class:`ExpertSlices`); the attention rank routes (the gate runs there) and
sends each FFN rank a work item of the rows that chose one of its experts::

    attention rank a (any A)                    ffn rank f (any F), experts [lo, hi)
    -------------------------                   ------------------------------------
    exchange(layer, hidden, routing):           loop:
      per FFN rank f with rows for it:            item = next_item()  # any attention
        rows of f (every row on rank 0 when       out = experts(item) # rank, arrival
        the model has shared experts), their      reply(item, out)    # order
        top-k: f's pairs, others weight 0 on
        expert lo                 ── WORK ──▶
      one REPLY per WORK sent     ◀── REPLY ──
      add the routed parts in rank order (fp32), shared part from rank 0

Nothing else crosses between steps: no plan, no lockstep between attention
ranks through AFD, and an FFN rank that no row of a layer chose gets no item.
The routing weights ride along (the FFN reduces over its experts, as vLLM's
kernel does) and the attention rank adds the FFN ranks' partial sums.

Exactness: with one FFN rank every row goes to it with its full routing, so
the FFN runs vLLM's kernel on exactly what plain vLLM runs it on. With
several, each rank's kernel sums its own experts and the attention rank adds
the partial sums in float32 and rounds once: the same sum in another order,
equal to plain vLLM's in float32 up to rounding (greedy output identical on
the test models, logprobs within 1e-4), not bit for bit.

Host work (the rows may live on a GPU; the headers, and the rows unless
they go into a ``cuda_ipc`` slot, leave from host memory):
:mod:`vllm_afd.connector.async_rows`.

Waits: an attention rank waits at most ``timeout_s`` (``warmup_timeout_s``
for start-up forwards) for its replies, and sees at once an FFN rank that
exited (EOF) or shut down. An FFN rank's wait for the next item is its idle
state: it ends with an item, when every attention rank shut down or dropped
its connection (an error naming the rank), or with :meth:`close`.

Connections: the p2p rendezvous (``p2p_rendezvous``, all-to-all topology,
fingerprints compared, shared secret) on ``afd.host:afd.port``; afterwards its
TCP connections carry the binary frames of ``async_wire``.

(Over 500 lines on purpose: the attention side and the FFN side are the two
halves of one exchange, each frame sent on one side read a few functions away
on the other.)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm_afd.connector import auth, p2p_rendezvous
from vllm_afd.connector.async_rows import (
    Group,
    HostBuffers,
    Sent,
    combine,
    group_rows,
    pick_rows,
    reply_is_output,
    view_bytes,
)
from vllm_afd.connector.async_slots import (
    DEPTH,
    Rings,
    check_ring_device,
    handshake,
    item_bytes,
    reply_ring,
    work_ring,
)
from vllm_afd.connector.async_wire import (
    Frame,
    FrameKind,
    FrameReader,
    encode_header,
    fresh_buffer,
    payload_bytes,
    send_all,
)
from vllm_afd.connector.payloads import ConnectorStats, Routing
from vllm_afd.connector.protocol import PROTOCOL_VERSION, REJOIN
from vllm_afd.errors import (
    AFDConfigError,
    AFDConnectorError,
    AFDPeerError,
    AFDProtocolError,
    AFDTimeoutError,
)
from vllm_afd.roles import AFDRole

if TYPE_CHECKING:
    from vllm_afd.config import AFDConfig
    from vllm_afd.connector.factory import ExchangeLimits
    from vllm_afd.connector.p2p_wire import Channel
    from vllm_afd.connector.protocol import Fingerprint
    from vllm_afd.topology import Topology

logger = logging.getLogger(__name__)

#: how the SHUTDOWN reason of an attention rank whose exchange failed begins
FAILED = "failed: "
#: how long close() tries to hand a peer its SHUTDOWN
_CLOSE_SEND_S = 1.0


@dataclass(frozen=True)
class ExpertSlices:
    """Which FFN rank owns which routed experts: contiguous slices, the
    first ``E mod F`` ranks one expert more."""

    num_experts: int
    num_ffn_ranks: int

    def __post_init__(self) -> None:
        if self.num_experts < self.num_ffn_ranks:
            raise AFDConfigError(
                f"afd.num_ffn_ranks={self.num_ffn_ranks} exceeds the model's "
                f"{self.num_experts} routed experts: with the async connector "
                "each FFN rank owns at least one expert"
            )

    def bounds(self, rank: int) -> tuple[int, int]:
        """``[lo, hi)``: the experts of FFN rank ``rank``."""
        q, m = divmod(self.num_experts, self.num_ffn_ranks)
        lo = rank * q + min(rank, m)
        return lo, lo + q + (rank < m)

    def owners(self) -> torch.Tensor:
        """``[E]`` int64: the FFN rank of each expert."""
        return torch.cat(
            [
                torch.full((hi - lo,), f, dtype=torch.int64)
                for f in range(self.num_ffn_ranks)
                for lo, hi in [self.bounds(f)]
            ]
        )


@dataclass
class WorkItem:
    """One work item as an FFN rank receives it.

    Attributes:
        source: the attention rank that sent it.
        layer: decoder layer.
        seq: the sender's item counter (the reply echoes it).
        hidden: ``[T, H]`` rows.
        routing: their ``[T, K]`` top-k, every id an expert of this rank.
        counts: rows routed to each local expert, in expert order.
        in_slot: its payload is in this rank's slot ring (``payload:
            shared`` or ``cuda_ipc``, where the rows are on the GPU; valid
            until the item is replied to).
    """

    source: int
    layer: int
    seq: int
    hidden: torch.Tensor
    routing: Routing
    counts: tuple[int, ...]
    in_slot: bool = False


@dataclass(frozen=True)
class Pending:
    """An exchange whose work items are sent and whose replies are not read
    yet (:meth:`AsyncAttention.dispatch`)."""

    layer: int
    hidden: torch.Tensor
    sent: Sent
    parts: int


class _Link:
    """One connection of an endpoint to a peer, in async frames, and its slot
    rings (``payload: shared`` or ``cuda_ipc``)."""

    def __init__(self, channel: Channel, rings: Rings) -> None:
        sock, pending = channel.detach()
        self.peer = channel.peer
        self.sock = sock
        self.reader = FrameReader(sock, channel.peer, pending)
        self.rings = rings
        if rings.mine is not None:
            self.reader.slot_for = rings.mine.slot
        self.lock = threading.Lock()  # one sender at a time
        self.seq = 0  # attention: items sent; ffn: not used
        self.replied = 0  # attention: the last item whose reply was added

    def slot(self, seq: int, nbytes: int) -> torch.Tensor | None:
        """The peer's slot for item ``seq``'s payload of ``nbytes``, or None
        where it travels on the socket: no slots, too large for one, or (an
        attention rank's item) ``DEPTH`` items of this link in flight."""
        ring = self.rings.theirs
        if ring is None or not ring.fits(nbytes) or self.seq - self.replied > DEPTH:
            return None
        return ring.slot(seq, nbytes)

    def send(self, parts: list[bytes | memoryview], deadline: float) -> int:
        with self.lock:
            return send_all(self.sock, parts, deadline, self.peer)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class AsyncEndpoint:
    """What both roles share: the rendezvous, the links, the counters."""

    def __init__(
        self,
        config: AFDConfig,
        role_rank: int,
        fingerprint: Fingerprint,
        topology: Topology,
        extra: dict[str, Any],
        max_tokens: int = 8192,
        ring_device: torch.device | None = None,
    ) -> None:
        self.name = "async"
        self.role = config.role
        self.role_rank = role_rank
        self.topology = topology
        self.fingerprint = fingerprint
        self.device = torch.device("cpu")
        self.host, self.port = config.host, config.port
        self.timeout_s: float = extra["timeout_s"]
        self.warmup_timeout_s: float = max(self.timeout_s, extra["warmup_timeout_s"])
        self.connect_timeout_s: float = extra["connect_timeout_s"]
        self.secret = auth.load_secret(extra["secret_file"])
        self.slices = ExpertSlices(fingerprint.num_experts, topology.num_ffn_ranks)
        #: how work items and replies travel (``async_slots``)
        self.payload: str = extra["payload"]
        self.max_tokens = max_tokens
        #: where the role computes: the GPU of ``payload: cuda_ipc`` rings
        self.ring_device = ring_device or torch.device("cpu")
        self.links: list[_Link] = []
        self._members: list[Channel] = []
        self._steps = self._a2f = self._f2a = self._errors = 0
        self._wait_s = 0.0
        self._closed = False
        self._started = False

    @property
    def stats(self) -> ConnectorStats:
        return ConnectorStats(
            self._steps, self._a2f, self._f2a, self._wait_s, self._errors
        )

    def start(self) -> None:
        """Rendezvous (at most ``connect_timeout_s``), then switch every
        connection to work-item frames.

        Raises: AFDProtocolError (fingerprints differ: the fields), AFDTimeoutError
        (a peer never came), AFDConnectorError.
        """
        if self._started:
            raise AFDConnectorError("start() was already called")
        self._started = True
        fp, topo = self.fingerprint, self.topology
        try:
            if self.role is AFDRole.FFN and self.role_rank == 0:
                joined = p2p_rendezvous.serve(
                    self.host, self.port, topo, fp, self.connect_timeout_s,
                    self.secret,
                )  # fmt: skip
            else:
                joined = p2p_rendezvous.join(
                    self.host, self.port, topo, self.role, self.role_rank, fp,
                    self.connect_timeout_s, self.secret,
                )  # fmt: skip
        except BaseException:
            self._errors += 1
            raise
        self._members = joined.members
        try:
            self.links = [
                _Link(ch, self._handshake(i, ch))
                for i, ch in enumerate(joined.channels)
            ]
        except BaseException:
            self._errors += 1
            for ch in self._members:
                ch.close()
            raise
        logger.info(
            "AFD connector up (async): %s rank %d, peers %s, topology %s (all to "
            "all), experts %s of %d, payload %s, protocol %d, fingerprint %s",
            self.role.value, self.role_rank, [link.peer for link in self.links],
            topo.name, self._my_experts(), self.slices.num_experts,
            self._payload_text(), PROTOCOL_VERSION, fp.digest,
        )  # fmt: skip

    def _handshake(self, peer: int, channel: Channel) -> Rings:
        """The payload plane of the connection to ``peer`` (``async_slots``):
        an FFN rank receives work items of up to ``max_tokens`` rows into its
        ring, an attention rank replies of as many."""
        fp = self.fingerprint
        dtype = getattr(torch, fp.dtype)
        attention = self.role is AFDRole.ATTENTION
        if attention:
            cols = fp.moe_output_parts * fp.hidden_size
            size = reply_ring(self.max_tokens, cols, dtype)
            who = f"ffn rank {peer}"
        else:
            size = work_ring(self.max_tokens, fp.hidden_size, dtype, fp.top_k)
            who = f"attention rank {peer}"
        label = f"{self.role.value}{self.role_rank}-{peer}"
        return handshake(
            channel, self.payload, size, label, who, self.connect_timeout_s,
            initiator=attention, device=self.ring_device,
        )  # fmt: skip

    def _payload_text(self) -> str:
        ring = self.links[0].rings.mine if self.links else None
        if ring is None:
            return self.payload
        where = "" if self.payload == "shared" else f" on {self.ring_device}"
        return (
            f"{self.payload} ({ring.size.depth} slots of "
            f"{ring.size.slot_bytes / 2**20:.1f} MiB per peer{where})"
        )

    def _my_experts(self) -> str:
        if self.role is AFDRole.ATTENTION:
            return "all routed by this rank"
        lo, hi = self.slices.bounds(self.role_rank)
        return f"{lo}..{hi - 1}"

    def note_step(self) -> None:
        """Count one forward step (attention) for the counters."""
        self._steps += 1

    def close(self, reason: str | None = None) -> None:
        """Tell every peer (SHUTDOWN) and drop the connections; idempotent."""
        if self._closed:
            return
        self._closed = True
        why = (reason or f"{self.role.value} rank {self.role_rank} closed").encode()
        head = encode_header(FrameKind.SHUTDOWN, nbytes=len(why))
        deadline = time.monotonic() + _CLOSE_SEND_S
        for link in self.links:
            with contextlib.suppress(AFDConnectorError):
                link.send([head, why], deadline)
            link.close()
        for ch in self._members:
            ch.close()


class AsyncAttention(AsyncEndpoint):
    """An attention rank's endpoint: dispatch by expert owner, combine."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: the FFN rank of each expert, on each device rows came from
        self._owners: dict[torch.device, torch.Tensor] = {}
        self._buffers = HostBuffers()
        self._failure: str | None = None
        #: the FFN rank whose failure ended this endpoint (None: none yet)
        self.lost_rank: int | None = None
        # held while exchanges are in flight: the watch reads the
        # connections only between exchanges
        self._io = threading.Lock()
        self._flight = threading.Lock()
        self._in_flight = 0

    def exchange(
        self,
        layer: int,
        hidden: torch.Tensor,
        routing: Routing,
        parts: int,
        shared_experts: bool,
        timeout_s: float,
    ) -> torch.Tensor:
        """The MoE output parts of ``hidden [T, H]`` routed by ``routing``:
        ``[T, parts * H]`` (``parts`` 2: shared | routed, added by the caller)
        on ``hidden``'s device, where ``routing`` must be too.

        Raises:
            AFDTimeoutError: a reply took longer than ``timeout_s``.
            AFDPeerError: an FFN rank exited, shut down or broke the protocol.
        """
        pending = self.dispatch(
            layer, hidden, routing, parts, shared_experts, timeout_s
        )
        return self.finish(pending, timeout_s)

    def dispatch(
        self,
        layer: int,
        hidden: torch.Tensor,
        routing: Routing,
        parts: int,
        shared_experts: bool,
        timeout_s: float,
    ) -> Pending:
        """The first half of :meth:`exchange`: send the work items of
        ``hidden``'s rows and return at once. Several may be in flight (one
        per micro-batch); each is finished with :meth:`finish` or dropped
        with :meth:`abandon`, in the order they were dispatched (an FFN rank
        replies to one attention rank's items in that order).

        Raises:
            AFDPeerError: an FFN rank is gone or read nothing in ``timeout_s``.
        """
        if self._failure is not None:
            raise AFDConnectorError(
                f"the async connector failed earlier: {self._failure}"
            )
        if parts == 1 and shared_experts and len(self.links) > 1:
            raise AFDConnectorError(
                "shared experts with several FFN ranks need the shared and routed "
                "outputs apart (moe_output_parts=2); the role split sets it"
            )
        self._hold()
        try:
            sent = self._dispatch(layer, hidden, routing, shared_experts, timeout_s)
        except BaseException as e:
            self._let_go()
            if isinstance(e, AFDConnectorError):
                self._fail(e)
            raise
        return Pending(layer, hidden, sent, parts)

    def finish(self, pending: Pending, timeout_s: float) -> torch.Tensor:
        """The second half of :meth:`exchange`: wait at most ``timeout_s`` for
        ``pending``'s replies and add them (``[T, parts * H]``)."""
        try:
            replies = self._collect(
                pending.layer, pending.sent, timeout_s, pending.hidden.device
            )
        except AFDConnectorError as e:
            self._fail(e)
            raise
        finally:
            self._let_go()
        out = combine(
            pending.hidden, pending.sent, replies, pending.parts, self._buffers
        )
        if reply_is_output(pending.sent) and self._in_ring(out, pending.sent[0][0]):
            out = out.clone()  # the slot is written again DEPTH replies later
        # The reads of GPU slots above are only queued: the next dispatch's
        # wait for this stream, before any header leaves, is what lets an
        # FFN rank write these slots again (stages on CUDA, running on
        # streams of their own, would need an event per link instead).
        for f, _, seq in pending.sent:  # their slots may take other items now
            self.links[f].replied = max(self.links[f].replied, seq)
        return out

    def _in_ring(self, t: torch.Tensor, f: int) -> bool:
        """Whether ``t`` is a view of this rank's reply ring for FFN rank ``f``."""
        ring = self.links[f].rings.mine
        return (
            ring is not None
            and t.device == ring.buffer.device
            and t.untyped_storage().data_ptr()
            == ring.buffer.untyped_storage().data_ptr()
        )

    def abandon(self, pending: Pending) -> None:
        """Drop ``pending`` unread (its micro-batch's step failed): this
        endpoint is done with, as after a failed exchange."""
        if self._failure is None:
            self._failure = f"layer {pending.layer}: an exchange was left unfinished"
        self._let_go()

    def _hold(self) -> None:
        """One more exchange in flight: the first keeps the watch off the
        connections (the lock is released by whichever thread ends the last)."""
        with self._flight:
            if self._in_flight == 0:
                self._io.acquire()
            self._in_flight += 1

    def _let_go(self) -> None:
        with self._flight:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._io.release()

    def _fail(self, error: AFDConnectorError) -> None:
        self._errors += 1
        self._failure = self._failure or str(error)

    def _dispatch(
        self,
        layer: int,
        hidden: torch.Tensor,
        routing: Routing,
        shared_experts: bool,
        timeout_s: float,
    ) -> Sent:
        """Send each FFN rank its work item; ``(rank, rows or None for all,
        seq)`` of each sent, in rank order (rows on ``hidden``'s device).

        Raises:
            AFDPeerError: an FFN rank is gone or read nothing in ``timeout_s``.
        """
        top_k = routing.topk_ids.shape[1]
        owners = self._owners.get(hidden.device)
        if owners is None:
            owners = self._owners[hidden.device] = self.slices.owners().to(
                hidden.device
            )
        groups = group_rows(owners, self.slices, routing, shared_experts)
        bodies = []
        for g in groups:
            link = self.links[g.rank]
            link.seq += 1
            n, k = g.ids.shape
            size = item_bytes(n, hidden.shape[1], hidden.dtype, k)
            slot = link.slot(link.seq, size)
            bodies.append(self._stage(g, hidden, slot))
        if hidden.device.type == "cuda":
            # the copies into pinned buffers or the FFN ranks' GPU slots were
            # queued on this stream: wait for them once before any frame leaves
            torch.cuda.current_stream(hidden.device).synchronize()
        deadline = time.monotonic() + timeout_s
        sent = []
        for g, body in zip(groups, bodies, strict=True):
            link = self.links[g.rank]
            in_slot = isinstance(body, int)
            if isinstance(body, int):  # in the FFN rank's slot: header alone
                nbytes, parts = body, []
            else:
                nbytes, parts = sum(len(b) for b in body), body
            head = encode_header(
                FrameKind.WORK, dtype=hidden.dtype, layer=layer, seq=link.seq,
                tokens=g.ids.shape[0], cols=hidden.shape[1], top_k=top_k,
                counts=g.counts, nbytes=nbytes, in_slot=in_slot,
            )  # fmt: skip
            try:
                link.send([head, *parts], deadline)
            except AFDConnectorError:
                self.lost_rank = g.rank
                raise
            self._a2f += nbytes
            sent.append((g.rank, g.rows, link.seq))
        return sent

    def _stage(
        self, group: Group, hidden: torch.Tensor, slot: torch.Tensor | None
    ) -> list[memoryview] | int:
        """The payload of ``group``'s work item: written into the FFN rank's
        ``slot`` when there is one (host memory, or its GPU's with ``payload:
        cuda_ipc``; its size returned), else in host memory: the rows
        themselves for every row of CPU ``hidden``, else the rows, ids and
        weights copied into the FFN rank's buffer. Copies from a CUDA device
        are queued: the caller waits for the stream before sending."""
        on_host = hidden.device.type == "cpu"
        if on_host and group.rows is None and slot is None:
            return payload_bytes(hidden, group.ids, group.weights)
        pinned = hidden.device.type == "cuda" and slot is None
        n, k = group.ids.shape
        act = n * hidden.shape[1] * hidden.dtype.itemsize  # the rows' bytes
        if slot is not None:
            buf = slot
        else:
            size = item_bytes(n, hidden.shape[1], hidden.dtype, k)
            buf = self._buffers.take(f"work{group.rank}", size, pinned)
        rows = view_bytes(buf, 0, hidden.dtype, (n, hidden.shape[1]))
        if on_host and group.rows is not None:
            torch.index_select(hidden, 0, group.rows, out=rows)
        else:
            rows.copy_(pick_rows(hidden, group.rows), non_blocking=pinned)
        view_bytes(buf, act, torch.int32, (n, k)).copy_(group.ids, non_blocking=pinned)
        at = act + 4 * n * k
        view_bytes(buf, at, torch.float32, (n, k)).copy_(
            group.weights, non_blocking=pinned
        )
        return buf.numel() if slot is not None else payload_bytes(buf)

    def _collect(
        self,
        layer: int,
        sent: Sent,
        timeout_s: float,
        device: torch.device,
    ) -> dict[int, torch.Tensor]:
        """One REPLY per item sent: ``{rank: out [T_f, C]}`` in host memory,
        valid until the next exchange unless the output is a CPU reply as it
        is (:func:`~vllm_afd.connector.async_rows.combine`; ``device``: the rows').

        Raises:
            AFDTimeoutError: a reply took longer than ``timeout_s``.
            AFDPeerError: an FFN rank exited, shut down or broke the protocol.
        """
        start = time.monotonic()
        deadline = start + timeout_s
        expect = {f: seq for f, _, seq in sent}
        got: dict[int, torch.Tensor] = {}
        # Replies are read into kept buffers (pinned for a CUDA device), but
        # for a CPU output that is a reply as it is, which the caller keeps.
        if device.type != "cpu" or not reply_is_output(sent):
            pinned = device.type == "cuda"
            for f in expect:
                self.links[f].reader.buffer_for = functools.partial(
                    self._buffers.take, f"reply{f}", pinned=pinned
                )
        try:
            while len(got) < len(expect):
                waiting = [f for f in expect if f not in got]
                for f in waiting:
                    self.lost_rank = f  # until its reply is read
                    # this reply only: the next may be another micro-batch's
                    for frame in self.links[f].reader.read(limit=1):
                        got[f] = self._reply_of(f, frame, layer, expect[f])
                    if f not in got and self.links[f].reader.eof:
                        raise AFDPeerError(
                            f"ffn rank {f} closed its connection (it exited or "
                            f"was killed) before replying to layer {layer}"
                        )
                if len(got) == len(expect):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.lost_rank = next(f for f in expect if f not in got)
                    names = ", ".join(f"ffn rank {f}" for f in expect if f not in got)
                    raise AFDTimeoutError(
                        f"timed out after {timeout_s:g}s waiting for the reply of "
                        f"{names} to layer {layer} (hung, stopped or overloaded)"
                    )
                socks = [self.links[f].sock for f in expect if f not in got]
                select.select(socks, [], [], remaining)
        finally:
            self._wait_s += time.monotonic() - start
            for f in expect:
                self.links[f].reader.buffer_for = fresh_buffer
        self.lost_rank = None
        return got

    def _reply_of(self, f: int, frame: Frame, layer: int, seq: int) -> torch.Tensor:
        if frame.kind is FrameKind.SHUTDOWN:
            raise AFDPeerError(f"ffn rank {f} shut down ({frame.reason})")
        if (
            frame.kind is not FrameKind.REPLY
            or frame.seq != seq
            or frame.layer != layer
        ):
            raise AFDProtocolError(
                f"ffn rank {f} sent {frame.kind.name} for layer {frame.layer} item "
                f"{frame.seq} where the reply to layer {layer} item {seq} belongs"
            )
        self._f2a += frame.payload.numel()
        return frame.tensors()[0]

    def close(self, reason: str | None = None) -> None:
        if self._failure is not None and reason is None:
            # the FFN ranks must not take this for a stop of the deployment
            reason = f"{FAILED}attention rank {self.role_rank}: {self._failure}"
        super().close(reason)

    def resume(self) -> None:
        """Nothing to do: a started endpoint serves at once (an FFN link
        calls it before the first exchange of a rejoined endpoint)."""

    def watch_peers(self, on_lost: Callable[..., None], period_s: float = 0.5) -> None:
        """Call ``on_lost(why, ffn_rank)`` once, from a thread, when an FFN
        rank's connection speaks between exchanges: its SHUTDOWN, or EOF (it
        exited or was killed). An exchange in flight reads its connections
        itself (the watch waits for it). Closing this endpoint is the
        caller's: an FFN link closes it telling the FFN ranks to rendezvous
        again, a plain ``close()`` tells them why it failed."""

        def run() -> None:
            while not self._closed:
                socks = [link.sock for link in self.links]
                try:
                    ready, _, _ = select.select(socks, [], [], period_s)
                except (OSError, ValueError):
                    return
                if not ready or self._closed:
                    continue
                if not self._io.acquire(blocking=False):
                    time.sleep(period_s / 10)  # an exchange reads its replies
                    continue
                try:
                    why = self._idle_news(ready)
                finally:
                    self._io.release()
                if why is not None and not self._closed:
                    self._failure = self._failure or why
                    on_lost(why, self.lost_rank)
                    return

        threading.Thread(target=run, name="afd-async-watch", daemon=True).start()

    def _idle_news(self, ready: list) -> str | None:
        """What the FFN ranks whose sockets are ``ready`` said between
        exchanges (None: nothing that ends the session)."""
        for f, link in enumerate(self.links):
            if link.sock not in ready:
                continue
            self.lost_rank = f  # unless it said nothing that ends the session
            try:
                frames = link.reader.read()
            except AFDProtocolError as e:
                return str(e)
            for frame in frames:
                if frame.kind is FrameKind.SHUTDOWN:
                    return f"ffn rank {f} shut down ({frame.reason})"
                return f"ffn rank {f} sent {frame.kind.name} between exchanges"
            if link.reader.eof:
                return f"ffn rank {f} closed its connection (it exited or was killed)"
        self.lost_rank = None
        return None


class AsyncFFN(AsyncEndpoint):
    """An FFN rank's endpoint: work items from any attention rank, in
    arrival order (a receiving thread reads every connection as frames come,
    so a sender never waits on this rank's compute).

    An item's rows are read into a host buffer kept for its attention rank
    (a fresh one of tens of MiB costs a page fault per 4 KiB), lent to the
    item until its reply is sent: an attention rank sends its next item
    once it has every reply, so one buffer per rank serves every item
    unless an item arrives while its rank's last one is still out (it then
    gets a fresh buffer).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._items: queue.Queue[WorkItem | BaseException | None] = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None
        self.lo, self.hi = self.slices.bounds(self.role_rank)
        #: attention rank -> the reason it shut down with
        self.shut_down: dict[int, str] = {}
        self._buffers = HostBuffers()
        #: attention rank -> the address of its kept buffer while lent
        self._lent: dict[int, int] = {}

    def start(self) -> None:
        super().start()
        for a, link in enumerate(self.links):
            link.reader.buffer_for = functools.partial(self._buffer_for, a)
        self._thread = threading.Thread(
            target=self._receive, name="afd-async-recv", daemon=True
        )
        self._thread.start()

    def _receive(self) -> None:
        """Read frames from every attention rank until all shut down."""
        live = set(range(len(self.links)))
        try:
            while live and not self._closed:
                socks = [self.links[a].sock for a in sorted(live)]
                watched: list[Any] = [self._wake_r, *socks]
                ready, _, _ = select.select(watched, [], [])
                if self._wake_r in ready or self._closed:
                    break
                for a in sorted(live):
                    link = self.links[a]
                    if link.sock not in ready:
                        continue
                    for frame in link.reader.read():
                        if frame.kind is FrameKind.WORK:
                            self._items.put(self._item(a, frame))
                            continue
                        self._give_back(a, frame.payload)
                        if frame.kind is FrameKind.SHUTDOWN:
                            self.shut_down[a] = frame.reason
                            live.discard(a)
                        else:
                            raise AFDProtocolError(
                                f"attention rank {a} sent {frame.kind.name} where "
                                "work items belong"
                            )
                    if a in live and link.reader.eof:
                        raise AFDPeerError(
                            f"attention rank {a} closed its connection without "
                            "SHUTDOWN (it exited or was killed)"
                        )
        except BaseException as e:  # handed to the loop: next_item raises it
            if not self._closed:  # (close() drops the sockets under this wait)
                self._errors += 1
                self._items.put(e)
                return
        self._items.put(None)

    def _item(self, a: int, frame: Frame) -> WorkItem:
        hidden, ids, weights = frame.tensors()
        # Ids on a GPU (payload cuda_ipc) are not read here: that would
        # synchronise this thread with the device. The slices follow from
        # the fingerprint both roles agreed on.
        on_host = ids.device.type == "cpu"
        if (
            on_host
            and ids.numel()
            and (int(ids.min()) < self.lo or int(ids.max()) >= self.hi)
        ):
            raise AFDProtocolError(
                f"attention rank {a} routed rows of layer {frame.layer} to experts "
                f"{int(ids.min())}..{int(ids.max())}, but ffn rank {self.role_rank} "
                f"owns experts {self.lo}..{self.hi - 1}: the roles disagree on "
                "the expert slices"
            )
        self._a2f += frame.payload.numel()
        return WorkItem(
            a, frame.layer, frame.seq, hidden, Routing(weights, ids), frame.counts,
            frame.in_slot,
        )  # fmt: skip

    def _buffer_for(self, a: int, nbytes: int) -> torch.Tensor:
        """The buffer a frame from attention rank ``a`` is read into: its
        kept one unless that is lent (or the frame is empty)."""
        if a in self._lent or not nbytes:
            return fresh_buffer(nbytes)
        buf = self._buffers.take(f"work{a}", nbytes)
        self._lent[a] = buf.data_ptr()
        return buf

    def _give_back(self, a: int, payload: torch.Tensor) -> None:
        """Attention rank ``a``'s kept buffer is free again, if ``payload``
        (what a frame or item was read into) was it."""
        if self._lent.get(a) == payload.data_ptr():
            del self._lent[a]

    def rejoining(self) -> str | None:
        """Once every attention rank shut down: why the session re-forms
        (an attention rank lost an FFN rank and left to rendezvous again:
        its ``rejoin:`` SHUTDOWN), or None when they stopped for good."""
        for reason in self.shut_down.values():
            if reason.startswith(REJOIN):
                return reason.removeprefix(REJOIN)
        return None

    def failed_peers(self) -> list[str]:
        """``attention rank a: why`` of each attention rank that shut down
        because its exchange failed."""
        return [
            reason.removeprefix(FAILED)
            for reason in self.shut_down.values()
            if reason.startswith(FAILED)
        ]

    def next_item(self) -> WorkItem | None:
        """The next work item from any attention rank (blocks while idle);
        None once every attention rank shut down or :meth:`close` was called.

        Raises:
            AFDPeerError: an attention rank dropped its connection.
            AFDProtocolError: one sent something else than work items.
        """
        start = time.monotonic()
        got = self._items.get()
        self._wait_s += time.monotonic() - start
        if got is None or isinstance(got, BaseException):
            self._items.put(got)  # later calls see the same end
        if isinstance(got, BaseException):
            raise got
        return got

    def reply(self, item: WorkItem, out: torch.Tensor) -> None:
        """Send ``out [T, C]`` (on any device) back to the item's attention
        rank (at most ``timeout_s`` for it to read). A reply that cannot be
        sent (the rank is gone or reads nothing) is dropped with a warning
        and counted as an error: what the loss means is the receiving
        thread's to say (:meth:`next_item`)."""
        link = self.links[item.source]
        nbytes = out.numel() * out.dtype.itemsize
        # in a slot only when the item came in one: the attention rank sent
        # it so because its reply slot is free (a third item in flight came
        # on the socket, and its reply goes back there)
        slot = link.slot(item.seq, nbytes) if item.in_slot else None
        if slot is not None:
            view_bytes(slot, 0, out.dtype, (out.shape[0], out.shape[1])).copy_(out)
            if slot.is_cuda:
                # the copy into the peer's GPU slot is queued: it must land
                # before the header tells the peer (a copy into a host slot
                # is done when copy_ returns)
                torch.cuda.current_stream(slot.device).synchronize()
            body: list[memoryview] = []
        else:
            body = payload_bytes(out.cpu())
        head = encode_header(
            FrameKind.REPLY, dtype=out.dtype, layer=item.layer, seq=item.seq,
            tokens=out.shape[0], cols=out.shape[1], nbytes=nbytes,
            in_slot=slot is not None,
        )  # fmt: skip
        deadline = time.monotonic() + self.timeout_s
        try:
            link.send([head, *body], deadline)
        except AFDConnectorError as e:
            self._release(item)
            # The receiving thread decides what the loss means: the rank's
            # SHUTDOWN (it left to rendezvous again, or stopped) or its EOF
            # (it died). The reply is dropped; the next item comes from the
            # other ranks, or the end from that thread.
            self._errors += 1
            logger.warning(
                "AFD async: ffn rank %d could not reply to attention rank %d "
                "(layer %d item %d): %s",
                self.role_rank, item.source, item.layer, item.seq, e,
            )  # fmt: skip
            return
        self._release(item)
        self._f2a += nbytes
        self._steps += 1

    def _release(self, item: WorkItem) -> None:
        """``item`` is done with: its source's kept buffer is free again if
        the item was read into it (its rows open the frame's payload)."""
        self._give_back(item.source, item.hidden)

    def close(self, reason: str | None = None) -> None:
        if not self._closed:
            super().close(reason)
            os.write(self._wake_w, b"x")
            self._items.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def __del__(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def build(
    config: AFDConfig,
    role_rank: int,
    fingerprint: Fingerprint,
    device: torch.device,
    topology: Topology,
    extra: dict[str, Any],
    limits: ExchangeLimits,
) -> AsyncEndpoint:
    """Factory hook for ``async``: the endpoint's frames are host memory and
    an exchange takes rows on any device; ``device`` is where the role
    computes, the GPU of ``payload: cuda_ipc`` rings. The slot rings hold
    ``limits.max_tokens`` rows."""
    check_ring_device(extra["payload"], device, f"this {config.role.value} rank")
    cls = AsyncAttention if config.role is AFDRole.ATTENTION else AsyncFFN
    return cls(
        config, role_rank, fingerprint, topology, extra, limits.max_tokens, device
    )
