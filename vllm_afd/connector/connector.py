"""The connector facade: the only API model and worker code calls.

Dimensions: T tokens of one attention rank's ubatch, ΣT merged tokens of an
FFN rank's ubatch, H hidden size, K top-k, C columns of an F2A tensor (H; on
MoE layers H * ``Fingerprint.moe_output_parts``).

::

    attention rank                            ffn rank
    --------------                            --------
    start()                                   start()
    send_plan(StepPlan) ------------------->  recv_plan() -> MergedPlan | None
    per layer, per ubatch:
      h = send_a2f(l, u, hidden, routing) -->  recv_a2f(l, u) -> A2FBatch
      out = recv_f2a(l, u)  <---------------  send_f2a(l, u, out)
    close()                                   close()

Threading model: one worker thread per endpoint calls everything; ``close``
may be called from any thread and wakes a blocked ``recv_plan``. A call made
by the wrong role raises AFDConnectorError at once.

Buffers are sized when the plan arrives and reused across layers and steps:
``recv_f2a``/``A2FBatch`` tensors are valid until the next receive of the same
ubatch_idx. Sent tensors must stay untouched until their handle is waited;
handles not waited explicitly are waited at the next step boundary.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from vllm_afd.connector.core import ATT, FFN, ConnectorCore, release_frames
from vllm_afd.connector.data import Capabilities
from vllm_afd.connector.payloads import (
    A2FBatch,
    RecvHandle,
    Routing,
    SendHandle,
)
from vllm_afd.connector.plan import MergedPlan, merge_plans
from vllm_afd.connector.protocol import (
    PROTOCOL_VERSION,
    ExecMode,
    Kind,
    StepPlan,
    exchange_tag,
)
from vllm_afd.errors import (
    AFDConnectorError,
    AFDError,
)

logger = logging.getLogger(__name__)
_CLOSE_DRAIN_S = 1.0
# Tag kinds as plain ints for protocol.exchange_tag on the hot path.
_HIDDEN, _F2A = int(Kind.A2F_HIDDEN), int(Kind.F2A)
_TOPK_W, _TOPK_IDS = int(Kind.A2F_TOPK_WEIGHTS), int(Kind.A2F_TOPK_IDS)


class AFDConnector(ConnectorCore):
    """One endpoint of the A2F/F2A exchange, built by ``factory.create_connector``."""

    @classmethod
    def assemble(
        cls,
        name: str,
        config: Any,
        role_rank: int,
        topology: Any,
        fingerprint: Any,
        device: torch.device,
        extra: dict[str, Any],
        control: Any,
        data: Any,
    ) -> AFDConnector:
        """An endpoint over a connector's planes, with the common options."""
        return cls(
            name=name,
            role=config.role,
            role_rank=role_rank,
            topology=topology,
            fingerprint=fingerprint,
            control=control,
            data=data,
            device=device,
            timeout_s=extra["timeout_s"],
            warmup_timeout_s=extra["warmup_timeout_s"],
        )

    def start(self) -> None:
        """Rendezvous and handshake; blocks at most ``connect_timeout_s``.

        Raises: AFDProtocolError (version/fingerprint mismatch, naming the
        fields), AFDTimeoutError (peers never came), AFDConnectorError.
        """
        if self._started:
            raise AFDConnectorError("start() was already called")
        self._started = True
        try:
            self._data.prepare()
            rendezvous = self._control.start(self.fingerprint, self._data.setup)
            self._data.start(rendezvous)
        except BaseException as e:
            self._errors += 1
            self._failure = e  # later calls say why, not just "closed"
            self.close()
            raise
        self._live = self.role
        if not self._data.capabilities.matches_tags:
            logger.warning(
                "AFD data plane %s pairs transfers by order only: a desynchronised "
                "exchange shows as wrong activations, not as an error",
                self._data.backend,
            )
        logger.info(
            "AFD connector up: role=%s rank=%d peers=%s connector=%s protocol=%d "
            "topology=%s fingerprint=%s",
            self.role.value, self.role_rank, list(self._peer_ranks), self.name,
            PROTOCOL_VERSION, self.topology.name, self.fingerprint.digest,
        )  # fmt: skip

    @property
    def rejoining(self) -> str | None:
        """FFN side, once ``recv_plan`` returned None: why the session ended
        for a rendezvous again (a member left, or a peer left to rejoin);
        None when the peers shut down for good."""
        return self._control.reform

    def rejoin_after_failure(self) -> str | None:
        """FFN side, once a step failed with a peer error or timeout: why the
        session re-forms (the attention ranks left it to rendezvous again, or
        are still connected after twice ``timeout_s``), or None when a served
        attention rank died or shut down for good. Blocks at most twice
        ``timeout_s``."""
        return self._control.rejoin_after_failure()

    @property
    def peer_gone(self) -> str | None:
        """FFN side, once ``rejoin_after_failure`` returned None: which served
        attention rank died (closed its connection without SHUTDOWN) or sent
        garbage, and how; None when none did (it shut down for good)."""
        return self._control.gone

    def close(self, reason: str | None = None) -> None:
        """Send SHUTDOWN (with ``reason``; begin it with ``protocol.REJOIN``
        when this endpoint rendezvous again), free sockets and the process
        group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._live = None
        if self._failure is None:
            for handle in self._pending_sends:
                try:
                    for work, *_ in handle._pending or ():
                        work.wait(_CLOSE_DRAIN_S)
                except AFDError:
                    break  # the peer is gone; nothing left to flush
        self._pending_sends.clear()
        self._control.close(reason or f"{self.role.value} rank {self.role_rank} closed")
        # Nothing may keep the data plane's group alive past close: its
        # connections close with it, which ends the peers' waits on this
        # endpoint at once (Gloo has no other way to). A failed step leaves
        # transfers in the step's state and in its error's frames.
        self._preposted.clear()
        self._a2f_plan.clear()
        self._f2a_plan.clear()
        if self._failure is not None:
            release_frames(self._failure)
        self._data.close()

    # ------------------------------------------------------------- attention
    def check(self) -> None:
        """Raise what the data plane reported from the device since the last
        call (cuda_ipc: a wait that timed out, was aborted, or met an
        exchange it did not expect). Call it once the step's device work has
        finished, before its results are used; ``send_plan`` and
        ``recv_plan`` call it too.
        """
        try:
            self._data.check()
        except AFDError as e:
            raise self._fail(e) from None

    def send_plan(self, plan: StepPlan) -> None:
        """Announce this rank's step to its FFN rank (outside any graph)."""
        self._check(ATT, "send_plan")
        refusal = capture_refusal(
            plan.mode, self.device.type, self._data.capabilities,
            self._data.backend or type(self._data).__name__,
        )  # fmt: skip
        if refusal is not None:
            raise AFDConnectorError(refusal)
        self._drain_sends()
        try:
            self._data.check()
            self._control.send_plan(plan)
        except AFDError as e:
            raise self._fail(e) from None
        self._plan = plan
        self._tokens = plan.ubatch_tokens
        self._begin_step(plan.step_id, plan.mode)
        if plan.mode is ExecMode.REPLAY:
            self._account_graph_step(plan.ubatch_tokens)

    def flush(self) -> None:
        """Wait for every send in flight (done anyway at the next step).

        Under CUDA graph capture this joins the transport's stream back into
        the captured one before the capture ends.
        """
        self._drain_sends()

    def account_graph_step(self) -> None:
        """FFN: count the bytes of the current step, replayed from a graph."""
        self._check(FFN, "account_graph_step")
        if self._tokens is not None:
            self._account_graph_step(self._tokens)

    @property
    def bounded_wait(self) -> bool:
        """A wait for a gone peer ends within ``timeout_s`` on this data
        plane, also inside a CUDA graph replay (so a step can fail instead
        of hanging; NCCL cannot)."""
        return self._data.capabilities.bounded_wait

    def resume(self) -> None:
        """Attention, after a rejoin: make the data plane's kept device state
        new before the first step on this connector; no step may run
        meanwhile (``worker.ffn_link`` holds its step lock)."""
        self._check(ATT, "resume")
        self._data.resume()

    def watch_peers(self, on_lost: Callable[[str], None]) -> None:
        """Call ``on_lost(message)`` once, from a thread, when the serving FFN
        rank shuts down or dies; the message names the peer and why.

        For hosts that can block where the connector has no timeout: a CUDA
        graph replay's transfers are waited on by the device, not by this
        connector. Nothing is called after :meth:`close`.
        """
        self._check(ATT, "watch_peers")

        def lost(peer: int, why: str) -> None:
            self._data.abort()  # device-side waits (cuda_ipc) end now
            if not self._closed:
                name = "the deployment" if peer < 0 else self._peer_name(peer)
                on_lost(f"{name} {why}")

        self._control.watch_peers(lost)

    def send_a2f(
        self,
        layer_idx: int,
        ubatch_idx: int,
        hidden: torch.Tensor,
        routing: Routing | None = None,
    ) -> SendHandle:
        """Start sending ``hidden [T, H]`` (and routing ``[T, K]``) to the FFN."""
        if self._live is not ATT:
            self._check(ATT, "send_a2f")
        n = self._planned(layer_idx, ubatch_idx)
        self._check_tensor("hidden", hidden, (n, self._hidden), self._dtype)
        if self._gate or routing is not None:
            extra = self._routing_parts(n, routing)
        else:
            extra = ()
        if n == 0:
            return SendHandle((), self._wait_all)
        peer = self._peers[0]
        bits = self._step_bits
        # The bytes leave first; the bookkeeping runs while they travel.
        tag = exchange_tag(bits, layer_idx, ubatch_idx, _HIDDEN)
        pending = [self._send(hidden.contiguous(), peer, tag)]
        for t, kind in extra:
            tag = exchange_tag(bits, layer_idx, ubatch_idx, kind)
            pending.append(self._send(t.contiguous(), peer, tag))
        handle = SendHandle(pending, self._wait_all)
        self._pending_sends.append(handle)
        self._a2f_bytes += n * self._a2f_row_bytes
        if self._data.prepost_recv:
            # Posted long before the FFN can answer: Gloo takes a slow path
            # for a message that arrives before its receive. Waiting it waits
            # this send first (free: the answer comes after the A2F arrived).
            early = self._post_f2a(layer_idx, ubatch_idx, n)
            early._before = handle
            self._preposted[(layer_idx, ubatch_idx)] = early
        return handle

    def _routing_parts(
        self, n: int, routing: Routing | None
    ) -> tuple[tuple[torch.Tensor, int], ...]:
        if not self._gate:
            raise AFDConnectorError(
                "send_a2f got routing but compute_gate_on_attention is off"
            )
        if routing is None:
            raise AFDConnectorError(
                "send_a2f needs routing: compute_gate_on_attention is on"
            )
        k = self._top_k
        w, ids = routing.topk_weights, routing.topk_ids
        self._check_tensor("topk_weights", w, (n, k), torch.float32)
        self._check_tensor("topk_ids", ids, (n, k), torch.int32)
        return ((w, _TOPK_W), (ids, _TOPK_IDS))

    def irecv_f2a(
        self, layer_idx: int, ubatch_idx: int, out: torch.Tensor | None = None
    ) -> RecvHandle:
        """Start receiving the FFN output ``[T, C]`` for (layer, ubatch); C is
        :meth:`f2a_cols` (H, or H * ``moe_output_parts`` on MoE layers).

        ``out`` receives in place; otherwise a connector buffer is used.
        """
        if self._live is not ATT:
            self._check(ATT, "irecv_f2a")
        early = self._preposted.pop((layer_idx, ubatch_idx), None)
        if early is not None:  # posted by send_a2f; lands in out on wait()
            if out is not None:
                self._check_tensor("out", out, early._result.shape, self._dtype)
                early._copy_to = out
            return early
        n = self._planned(layer_idx, ubatch_idx)
        cols = self.f2a_cols(layer_idx)
        if out is not None:
            self._check_tensor("out", out, (n, cols), self._dtype)
        if n == 0:
            buf = out if out is not None else torch.empty(0, cols)
            return RecvHandle((), buf.to(self.device, self._dtype), self._wait_all)
        return self._post_f2a(layer_idx, ubatch_idx, n, out)

    def _post_f2a(
        self,
        layer_idx: int,
        ubatch_idx: int,
        n: int,
        out: torch.Tensor | None = None,
    ) -> RecvHandle:
        cols = self.f2a_cols(layer_idx)
        if out is None or not out.is_contiguous():
            # Two buffers per ubatch, by layer parity: the output of layer L
            # stays valid while the receive of layer L+1 is in flight.
            slot = 2 * ubatch_idx + (layer_idx & 1)
            buf = self._buffer("f2a", slot, (n, cols), self._dtype)
        else:
            buf = out
        self._f2a_bytes += n * cols * self._itemsize
        tag = exchange_tag(self._step_bits, layer_idx, ubatch_idx, _F2A)
        pending = [self._recv(buf, self._peers[0], tag)]
        copy_to = out if out is not None and buf is not out else None
        return RecvHandle(pending, buf, self._wait_all, copy_to)

    def recv_f2a(
        self, layer_idx: int, ubatch_idx: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Blocking :meth:`irecv_f2a`: the FFN output ``[T, C]``."""
        return self.irecv_f2a(layer_idx, ubatch_idx, out).wait()

    # ------------------------------------------------------------------- ffn
    def recv_plan(self) -> MergedPlan | None:
        """Wait (idle, no timeout) for the next step of every attention peer.

        Returns None when the peers shut down cleanly or ``close`` was called.
        Raises: AFDPeerError (a peer died), AFDProtocolError (peers disagree).
        """
        self._check(FFN, "recv_plan")
        self._drain_sends()
        try:
            self._data.check()
            plans = self._control.recv_plans()
            if plans is None:
                self._merged = self._tokens = None
                return None
            merged = merge_plans(self._peer_ranks, plans)
        except AFDError as e:
            raise self._fail(e) from None
        self._merged = merged
        self._tokens = merged.ubatch_tokens
        self._begin_step(merged.step_id, merged.mode)
        self._a2f_plan.clear()
        self._f2a_plan.clear()
        return merged

    def recv_a2f(self, layer_idx: int, ubatch_idx: int) -> A2FBatch:
        """The merged A2F batch ``[ΣT, H]`` of (layer, ubatch), peers in order."""
        if self._live is not FFN:
            self._check(FFN, "recv_a2f")
        total = self._planned(layer_idx, ubatch_idx)
        batch, targets, nbytes = self._a2f_plan.get(ubatch_idx) or self._a2f_targets(
            ubatch_idx, total
        )
        bits, recv = self._step_bits, self._recv
        pending = [
            recv(buf, peer, exchange_tag(bits, layer_idx, ubatch_idx, kind))
            for peer, bufs in targets
            for buf, kind in bufs
        ]
        self._a2f_bytes += nbytes
        self._wait_all(pending)
        return batch

    def _a2f_targets(
        self, ubatch_idx: int, total: int
    ) -> tuple[A2FBatch, list[tuple[int, list]], int]:
        """Buffers and per-peer slices of one ubatch, built once per step."""
        m = self._merged
        assert m is not None  # set with the step's tokens, which _planned found
        hidden = self._buffer("a2f", ubatch_idx, (total, self._hidden), self._dtype)
        bufs = [(hidden, _HIDDEN)]
        routing = None
        if self._gate:
            k = self._top_k
            w = self._buffer("topk_w", ubatch_idx, (total, k), torch.float32)
            ids = self._buffer("topk_ids", ubatch_idx, (total, k), torch.int32)
            routing = Routing(w, ids)
            bufs += [(w, _TOPK_W), (ids, _TOPK_IDS)]
        targets = []
        for i, peer in enumerate(self._peers):
            n = m.peer_tokens[i][ubatch_idx]
            off = m.offsets[i][ubatch_idx]
            if n == total:
                targets.append((peer, bufs))  # the only peer with tokens
            elif n:
                targets.append((peer, [(b[off : off + n], k) for b, k in bufs]))
        entry = (A2FBatch(hidden, routing), targets, total * self._a2f_row_bytes)
        self._a2f_plan[ubatch_idx] = entry
        return entry

    def send_f2a(
        self, layer_idx: int, ubatch_idx: int, out: torch.Tensor
    ) -> SendHandle:
        """Start returning ``out [ΣT, C]`` to the peers, each its own slice."""
        if self._live is not FFN:
            self._check(FFN, "send_f2a")
        total = self._planned(layer_idx, ubatch_idx)
        cols = self.f2a_cols(layer_idx)
        self._check_tensor("out", out, (total, cols), self._dtype)
        out = out.contiguous()
        tag = exchange_tag(self._step_bits, layer_idx, ubatch_idx, _F2A)
        slices = self._f2a_plan.get(ubatch_idx)
        if slices is None:
            slices = self._f2a_slices(ubatch_idx, total)
        send = self._send
        pending = [
            send(out if n == total else out[off : off + n], peer, tag)
            for peer, off, n in slices
        ]
        self._f2a_bytes += total * cols * self._itemsize
        handle = SendHandle(pending, self._wait_all)
        if pending:
            self._pending_sends.append(handle)
        return handle

    def _f2a_slices(self, ubatch_idx: int, total: int) -> list[tuple[int, int, int]]:
        """(peer, offset, tokens) of each peer with tokens in ``ubatch_idx``."""
        m = self._merged
        assert m is not None  # set with the step's tokens, which _planned found
        slices = [
            (peer, m.offsets[i][ubatch_idx], m.peer_tokens[i][ubatch_idx])
            for i, peer in enumerate(self._peers)
            if m.peer_tokens[i][ubatch_idx]
        ]
        self._f2a_plan[ubatch_idx] = slices
        return slices


def capture_refusal(
    mode: ExecMode, device_type: str, capabilities: Capabilities, backend: str
) -> str | None:
    """Why a step of ``mode`` cannot be captured over this data plane, or None.

    A CUDA graph records CUDA work only: a plane that is not
    ``graph_capturable`` (Gloo: host-side transfers) would be recorded as
    nothing and move no tensor on replay. A CPU connector is never captured
    (the unit tests' CPU stand-in graphs run its planes eagerly)."""
    if mode is not ExecMode.CAPTURE or device_type != "cuda":
        return None
    if capabilities.graph_capturable:
        return None
    return (
        f"the {backend} data plane cannot be captured in a CUDA graph; serve with "
        "--enforce-eager, or use a capturable backend "
        "(connector_extra_config.backend 'nccl' or 'cuda_ipc')"
    )
