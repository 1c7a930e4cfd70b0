"""Control plane of the p2p connector: plans, heartbeats and SHUTDOWN over
plain TCP.

FFN rank 0 listens on ``afd.host:afd.port`` for the rendezvous (see
``p2p_rendezvous``); afterwards every attention rank holds one connection to
the FFN rank that serves it. The FFN side waits on its peers' sockets and a
wake-up pipe with ``select``, so a dead peer (EOF) or ``close()`` from another
thread ends an idle wait at once.

Every ``heartbeat_interval_s`` the FFN side sends a HEARTBEAT on each of its
connections, from a thread of its own (compute does not delay it). An
attention rank that has heard nothing from its FFN rank for ``timeout_s``
counts it as gone (hung, stopped, or cut off), as it does an EOF or SHUTDOWN;
until it planned its first served (EAGER or REPLAY) step the limit is
``warmup_timeout_s``, as for the waits of start-up steps.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

from vllm_afd.connector import auth, p2p_rendezvous, protocol
from vllm_afd.connector.control import ControlPlane, Rendezvous, SetupFn
from vllm_afd.connector.p2p_wire import Channel
from vllm_afd.connector.protocol import ExecMode, Fingerprint, MsgType, StepPlan
from vllm_afd.errors import AFDPeerError, AFDProtocolError, AFDTimeoutError
from vllm_afd.roles import AFDRole
from vllm_afd.topology import Topology

logger = logging.getLogger(__name__)
_HEARTBEAT = MsgType.HEARTBEAT.value
#: the peer ``watch_peers`` names when the session itself ends
SESSION = -1
#: FFN side: this process returned a served (EAGER or REPLAY) step in some
#: session. From then on a WARMUP plan is an idle data-parallel rank's dummy
#: forward, not a start-up compile, and a peer lagging behind it is waited
#: ``timeout_s`` (also in a session re-formed in this process).
_served_in_process = False

#: seconds after the first plan of a step arrived from some attention ranks
#: that an FFN rank logs which ranks' plans it still waits for (once a step)
PLAN_LAG_WARN_S = 10.0


def _note_served(plans: list[StepPlan]) -> None:
    global _served_in_process
    if not _served_in_process:
        _served_in_process = any(
            p.mode in (ExecMode.EAGER, ExecMode.REPLAY) for p in plans
        )


class P2PControlPlane(ControlPlane):
    """TCP control plane; see ``control.ControlPlane`` for the contract."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        topology: Topology,
        role: AFDRole,
        role_rank: int,
        timeout_s: float,
        connect_timeout_s: float,
        secret: bytes | None = None,
        warmup_timeout_s: float | None = None,
        heartbeat_interval_s: float = 1.0,
    ) -> None:
        self._host, self._port, self._topo = host, port, topology
        self._secret = secret
        self._role, self._rank = role, role_rank
        self._timeout_s, self._connect_timeout_s = timeout_s, connect_timeout_s
        self._heartbeat_s = heartbeat_interval_s
        # the lagging-peer wait of a WARMUP/CAPTURE step (peers compile then)
        self._warmup_timeout_s = max(timeout_s, warmup_timeout_s or timeout_s)
        # Attention: a served step (EAGER or REPLAY) was planned; until then
        # the heartbeat silence may last warmup_timeout_s (start-up compiles).
        self._serving = False
        self._channels: list[Channel] = []
        self._members: list[Channel] = []  # the session's membership (leg 1)
        self._heard: list[float] = []  # per channel: when the peer last spoke
        self._stop = threading.Event()
        self._peers = topology.peers(role, role_rank)
        self._peer_global = topology.peer_global_ranks(role, role_rank)
        self._shutdown: dict[int, str] = {}  # peer index -> reason
        #: FFN rank k > 0: why FFN rank 0 shut down for good (None: it did not)
        self.host_stopped: str | None = None
        self._host_stopped_at = 0.0
        self._wake_r, self._wake_w = os.pipe()
        self._lock = threading.Lock()
        self._io_lock = threading.Lock()
        self._closed = False

    def start(
        self, fingerprint: Fingerprint, setup: SetupFn | None = None
    ) -> Rendezvous:
        if self._secret is None and not auth.is_loopback(self._host):
            logger.warning(
                "AFD rendezvous on %s:%d is not on loopback and has no shared "
                "secret: any host that reaches it can join; set %s on every role",
                self._host, self._port, auth.HOW,
            )  # fmt: skip
        if self._role is AFDRole.FFN and self._rank == 0:
            joined = p2p_rendezvous.serve(
                self._host, self._port, self._topo, fingerprint,
                self._connect_timeout_s, self._secret,
            )  # fmt: skip
        else:
            joined = p2p_rendezvous.join(
                self._host, self._port, self._topo, self._role, self._rank,
                fingerprint, self._connect_timeout_s, self._secret,
            )  # fmt: skip
        self._channels = joined.channels
        self._members = joined.members
        blobs: tuple[dict, ...] = ()
        if setup is not None:
            deadline = time.monotonic() + self._connect_timeout_s
            try:
                blobs = p2p_rendezvous.swap_setup(
                    self._channels, self._role, setup, deadline,
                    self._connect_timeout_s,
                )  # fmt: skip
            except BaseException:
                for ch in self._channels + self._members:
                    ch.close()
                raise
        self._heard = [time.monotonic()] * len(self._channels)
        if self._role is AFDRole.FFN and self._channels:
            threading.Thread(
                target=self._beat, name="afd-heartbeat", daemon=True
            ).start()
        return Rendezvous(joined.session, joined.local_host, blobs)

    def _beat(self) -> None:
        """FFN side: a HEARTBEAT on every connection each interval."""
        beat = protocol.heartbeat()
        while not self._stop.wait(self._heartbeat_s):
            with self._io_lock:
                if self._closed:
                    return
                for ch in self._channels:
                    if ch.writable:
                        with contextlib.suppress(AFDPeerError):
                            ch.send(beat)

    # ---------------------------------------------------------- attention
    def send_plan(self, plan: StepPlan) -> None:
        ch = self._channels[0]
        with self._io_lock:  # the peer watch reads this socket too
            why = self._failure_of(0)
            if why is not None:
                raise AFDPeerError(
                    f"{ch.peer} {why}; cannot send the plan of step {plan.step_id}"
                )
            ch.send(plan.to_wire())
        if plan.mode in (ExecMode.EAGER, ExecMode.REPLAY):
            self._serving = True

    def lost_in(self) -> float:
        if self._role is not AFDRole.ATTENTION or not self._heard:
            return math.inf
        return self._heard[0] + self._silence_limit()[1] - time.monotonic()

    def _silence_limit(self) -> tuple[str, float]:
        """The heartbeat silence that makes the FFN rank lost, and its key."""
        if self._serving:
            return "timeout_s", self._timeout_s
        # warming up: the FFN may be slow to answer
        return "warmup_timeout_s", self._warmup_timeout_s

    def watch_peers(self, on_lost: Callable[[int, str], None]) -> None:
        # The FFN rank sends only HEARTBEAT and SHUTDOWN on this socket; the
        # watch reads them as they come and looks at the silence at least
        # every heartbeat interval.
        period = min(1.0, self._heartbeat_s)

        def watch() -> None:
            ch = self._channels[0]
            while not self._closed:
                socks: list[int | socket.socket] = [
                    self._wake_r,
                    ch.sock,
                    *(m.sock for m in self._members),
                ]
                try:
                    ready, _, _ = select.select(socks, [], [], period)
                except (OSError, ValueError):
                    return
                if self._closed or self._wake_r in ready:
                    return
                with self._io_lock:
                    peer, why = self._peer_global[0], self._failure_of(0)
                    if why is None and (left := self._member_left()) is not None:
                        peer, why = SESSION, f"re-forms: {left}"
                if why is not None:
                    if not self._closed:
                        on_lost(peer, why)
                    return

        threading.Thread(target=watch, name="afd-peer-watch", daemon=True).start()

    def _member_left(self) -> str | None:
        """Who of the session's membership left to rendezvous again, or died;
        None if nobody. A member that shuts down for good (a clean stop) is
        let go: the deployment is stopping. When that member is FFN rank 0,
        the session's host (the only member of an FFN rank k > 0), this FFN
        rank stops too once its peers sent no plan for ``timeout_s``
        (:attr:`host_stopped`): they may be on a node whose launcher nothing
        else tells (a headless one, idle)."""
        for ch in list(self._members):
            try:
                ch.fill()
            except AFDProtocolError as e:
                return f"{ch.peer} sent garbage ({e})"
            for msg in ch.inbox:
                if msg["type"] == MsgType.SHUTDOWN.value:
                    reason = str(msg.get("reason", ""))
                    if reason.startswith(protocol.REJOIN):
                        return f"{ch.peer} shut down ({reason})"
                    self._members.remove(ch)
                    ch.close()
                    if self._role is AFDRole.FFN and self._rank > 0:
                        self.host_stopped = f"{ch.peer} shut down ({reason})"
                        self._host_stopped_at = time.monotonic()
                    break
            else:
                if ch.eof:
                    return f"{ch.peer} closed its connection (it exited or was killed)"
        return None

    # ---------------------------------------------------------------- ffn
    def recv_plans(self) -> list[StepPlan] | None:
        chans = self._channels
        plans: list[StepPlan | None] = [None] * len(chans)
        first_at: float | None = None
        lag_logged = False
        while True:
            for i, ch in enumerate(chans):
                if plans[i] is not None:
                    continue
                if ch.inbox:
                    msg = ch.inbox.popleft()
                    if msg["type"] == MsgType.SHUTDOWN.value:
                        reason = self._shutdown[i] = str(msg.get("reason", ""))
                        if reason.startswith(protocol.REJOIN):
                            self.reform = f"{ch.peer} shut down ({reason})"
                        return None
                    if msg["type"] != MsgType.PLAN.value:
                        raise AFDProtocolError(
                            f"expected PLAN from {ch.peer}, got {msg['type']}"
                        )
                    plans[i] = StepPlan.from_wire(msg)
                    first_at = first_at or time.monotonic()
                elif ch.eof:
                    raise AFDPeerError(
                        f"{ch.peer} closed its connection without SHUTDOWN (it "
                        "exited or was killed) while this ffn rank waited for its "
                        "next step plan"
                    )
            received = [p for p in plans if p is not None]
            if len(received) == len(plans):
                _note_served(received)
                return received
            timeout = None
            if first_at is not None:
                first = next(p for p in plans if p is not None)
                slow = first.mode is ExecMode.CAPTURE or (
                    first.mode is ExecMode.WARMUP and not _served_in_process
                )
                limit = self._warmup_timeout_s if slow else self._timeout_s
                timeout = first_at + limit - time.monotonic()
                if timeout <= 0:
                    missing = [chans[i].peer for i, p in enumerate(plans) if p is None]
                    raise AFDTimeoutError(
                        f"timed out after {limit}s waiting for the plan "
                        f"of step {first.step_id} from {', '.join(missing)}"
                    )
            if first_at is not None and not lag_logged:
                warn_in = first_at + PLAN_LAG_WARN_S - time.monotonic()
                if warn_in <= 0:
                    lag_logged = True
                    self._log_plan_lag(plans, time.monotonic() - first_at, limit)
                else:
                    timeout = warn_in if timeout is None else min(timeout, warn_in)
            waiting = [c for i, c in enumerate(chans) if not (plans[i] or c.inbox)]
            if self._closed:
                return None
            if (left := self._member_left()) is not None:
                self.reform = left
                return None
            if self.host_stopped is not None and not received:
                # Between steps: the deployment stops. Peers still finishing
                # their last steps send them within timeout_s; peers that idle
                # (a headless node's) send nothing: then stop as after their
                # SHUTDOWN.
                grace = self._host_stopped_at + self._timeout_s - time.monotonic()
                if grace <= 0:
                    logger.info("AFD %s: the deployment stops", self.host_stopped)
                    return None
                timeout = grace if timeout is None else min(timeout, grace)
            watched: list[int | Channel] = [self._wake_r, *waiting, *self._members]
            try:
                ready, _, _ = select.select(watched, [], [], timeout)
            except (OSError, ValueError):
                if self._closed:
                    return None
                raise
            if self._wake_r in ready or self._closed:
                return None
            for r in ready:
                if isinstance(r, Channel):  # every one: a ready wake-up pipe returned
                    r.fill()

    def _log_plan_lag(
        self, plans: list[StepPlan | None], lag_s: float, limit_s: float
    ) -> None:
        """Say which attention ranks a step waits for: the others sent its plan
        and (on a device data plane) already wait for this rank's reply."""
        sent = [(self._channels[i].peer, p) for i, p in enumerate(plans) if p]
        missing = [self._channels[i].peer for i, p in enumerate(plans) if p is None]
        first = sent[0][1]
        logger.warning(
            "AFD ffn rank %d: %s sent the plan of step %d (%s) %.0fs ago; still "
            "waiting for the plan from %s (a lagging rank is waited %.0fs)",
            self._rank, ", ".join(peer for peer, _ in sent), first.step_id,
            first.mode.name, lag_s, ", ".join(missing), limit_s,
        )  # fmt: skip

    def rejoin_after_failure(self) -> str | None:
        """A step failed mid-way: the session re-forms unless a served
        attention rank died (EOF without SHUTDOWN), sent garbage (either is
        kept in ``gone``), or shut down for good. An attention rank that gave
        up on this rank (it was stopped, hung or cut off) shuts down with a
        ``REJOIN`` reason once its own step wait ends, within ``timeout_s``:
        the wait lasts until every served rank left, at most twice
        ``timeout_s``. Ranks still connected then are told to re-form by this
        endpoint's ``close`` (its reason begins with ``REJOIN``)."""
        wait_s = 2 * self._timeout_s
        deadline = time.monotonic() + wait_s
        while True:
            rejoin, connected = None, []
            for i, ch in enumerate(self._channels):
                why = self._failure_of(i)  # records a SHUTDOWN's reason
                reason = self._shutdown.get(i)
                if why is None:
                    connected.append(ch)
                elif reason is None:
                    self.gone = f"{ch.peer} {why}"  # died or sent garbage
                    return None
                elif not reason.startswith(protocol.REJOIN):
                    return None  # stopped for good
                else:
                    rejoin = rejoin or f"{ch.peer} {why}"
            left = deadline - time.monotonic()
            if not connected or left <= 0 or self._closed:
                break
            watched: list[int | Channel] = [self._wake_r, *connected]
            try:
                ready, _, _ = select.select(watched, [], [], left)
            except (OSError, ValueError):
                return None
            if self._wake_r in ready:
                return None
        if self._closed:
            return None
        self.reform = rejoin or (
            f"{', '.join(c.peer for c in connected)} still connected "
            f"{wait_s:g}s after the failed step"
        )
        return self.reform

    # --------------------------------------------------------------- both
    def peer_failure(self, peer: int) -> str | None:
        try:
            index = self._peer_global.index(peer)
        except ValueError:
            return None
        return self._failure_of(index)

    def peer_stopped(self, peer: int) -> bool:
        try:
            reason = self._shutdown.get(self._peer_global.index(peer))
        except ValueError:
            return False
        return reason is not None and not reason.startswith(protocol.REJOIN)

    def _failure_of(self, index: int) -> str | None:
        if index in self._shutdown:
            return f"shut down ({self._shutdown[index]})"
        if index >= len(self._channels) or self._closed:
            return None
        ch = self._channels[index]
        try:
            ch.fill()
        except AFDProtocolError as e:
            return f"sent garbage ({e})"
        if self._role is AFDRole.ATTENTION and ch.inbox:
            # What the FFN side sends: HEARTBEAT (consumed here), SHUTDOWN.
            # (send_plan comes here every step: nothing to do when nothing came)
            beats = len(ch.inbox)
            ch.inbox = deque(m for m in ch.inbox if m["type"] != _HEARTBEAT)
            if beats != len(ch.inbox):
                self._heard[index] = time.monotonic()
        for msg in list(ch.inbox):
            if msg["type"] == MsgType.SHUTDOWN.value:
                self._shutdown[index] = str(msg.get("reason", ""))
                return f"shut down ({self._shutdown[index]})"
        if ch.eof:
            return "closed its connection (it exited or was killed)"
        if self._role is AFDRole.ATTENTION and index < len(self._heard):
            silent = time.monotonic() - self._heard[index]
            key, limit = self._silence_limit()
            if silent >= limit:
                return (
                    f"sent no heartbeat for {silent:.1f}s ({key}={limit:g}): it "
                    "is hung, stopped or cut off"
                )
        return None

    def close(self, reason: str = "closed") -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        os.write(self._wake_w, b"x")
        with self._io_lock:
            for ch in [*self._channels, *self._members]:
                if ch.writable:
                    with contextlib.suppress(AFDPeerError):
                        ch.send(protocol.shutdown(reason))
                ch.close()
        # The pipe stays open: a recv_plans in another thread may still select
        # on it; it is freed with this object.

    def __del__(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
