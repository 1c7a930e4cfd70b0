"""In-process connector for tests: every endpoint is a thread of one process.

Dimensions: T tokens, H hidden size (see ``protocol``).

Endpoints that use the same ``afd.host:afd.port`` meet in a process-global
:class:`_Hub`. Plans travel as Python objects, tensors as clones keyed by the
same 31-bit tag the p2p transport uses, so the loopback connector checks
exactly what the p2p one checks. A peer whose threads (the one that built it
and those that drove it) have all exited without ``close()`` counts as dead,
like a killed process.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from vllm_afd.connector.control import ControlPlane, Rendezvous, SetupFn
from vllm_afd.connector.data import DataPlane, Work
from vllm_afd.connector.protocol import Fingerprint, StepPlan
from vllm_afd.errors import (
    AFDConnectorError,
    AFDPeerError,
    AFDProtocolError,
    AFDTimeoutError,
)
from vllm_afd.roles import AFDRole
from vllm_afd.topology import Topology

if TYPE_CHECKING:
    from vllm_afd.config import AFDConfig
    from vllm_afd.connector.connector import AFDConnector

_POLL_S = 0.05
_HUBS: dict[str, _Hub] = {}
_HUBS_LOCK = threading.Lock()


class _Shutdown:
    def __init__(self, reason: str) -> None:
        self.reason = reason


class _Hub:
    """Shared state of one loopback deployment (all guarded by ``cond``)."""

    def __init__(self, key: str, topology: Topology) -> None:
        self.key, self.topology = key, topology
        self.cond = threading.Condition()
        # rank -> (fingerprint, threads that built or drove it): a member is
        # dead once all of them have exited without close().
        self.members: dict[int, tuple[Fingerprint, list[threading.Thread]]] = {}
        self.closed: dict[int, str] = {}
        self.rejected: str | None = None
        self.session = uuid.uuid4().hex[:12]
        self.plans: defaultdict[tuple[int, int], deque[Any]] = defaultdict(deque)
        self.mail: defaultdict[tuple[int, int, int], deque[torch.Tensor]] = defaultdict(
            deque
        )

    def name(self, rank: int) -> str:
        role, r = self.topology.role_of(rank)
        return f"{role.value} rank {r}"

    def touch(self, rank: int) -> None:
        """The calling thread now drives ``rank`` (its exit means death)."""
        member = self.members.get(rank)
        me = threading.current_thread()
        if member is not None and me not in member[1]:
            member[1][:] = [t for t in member[1] if t.is_alive()] + [me]

    def failure(self, rank: int) -> str | None:
        if rank in self.closed:
            return f"shut down ({self.closed[rank]})"
        member = self.members.get(rank)
        if member is not None and not any(t.is_alive() for t in member[1]):
            return "exited without close()"
        return None

    def wait_for(
        self, ready: Callable[[], bool], peer: int, deadline: float | None
    ) -> None:
        """Wait (``cond`` held) until ``ready()``; raise if ``peer`` is gone."""
        while not ready():
            why = self.failure(peer)
            if why is not None:
                raise AFDPeerError(f"{self.name(peer)} {why}")
            if deadline is not None and time.monotonic() >= deadline:
                raise AFDTimeoutError("nothing arrived")
            self.cond.wait(_POLL_S)


def _hub(key: str, topology: Topology, me: int) -> _Hub:
    with _HUBS_LOCK:
        hub = _HUBS.get(key)
        # A hub where this rank already joined and is now gone is stale (left
        # by a failed deployment): start a fresh one.
        stale = hub is not None and me in hub.members and hub.failure(me) is not None
        if hub is None or stale or hub.topology != topology:
            hub = _HUBS[key] = _Hub(key, topology)
        return hub


class LoopbackControlPlane(ControlPlane):
    """Control plane over a :class:`_Hub`."""

    def __init__(
        self,
        *,
        key: str,
        topology: Topology,
        role: AFDRole,
        role_rank: int,
        timeout_s: float,
        connect_timeout_s: float,
    ) -> None:
        self._key, self._topo = key, topology
        self._me = topology.global_rank(role, role_rank)
        self._peers = topology.peer_global_ranks(role, role_rank)
        self._timeout_s, self._connect_timeout_s = timeout_s, connect_timeout_s
        self.hub: _Hub | None = None
        self._closed = False
        self._owner = threading.current_thread()

    def start(
        self, fingerprint: Fingerprint, setup: SetupFn | None = None
    ) -> Rendezvous:
        # One process: both ends share the loopback data plane, which has no
        # setup record to swap.
        hub = self.hub = _hub(self._key, self._topo, self._me)
        deadline = time.monotonic() + self._connect_timeout_s
        with hub.cond:
            if self._me in hub.members:
                raise AFDConnectorError(
                    f"{hub.name(self._me)} joined loopback {self._key} twice"
                )
            for rank, (fp, _) in hub.members.items():
                fields = fp.diff(fingerprint)
                if fields and hub.rejected is None:
                    detail = fp.describe_diff(
                        fingerprint, hub.name(rank), hub.name(self._me)
                    )
                    hub.rejected = (
                        f"fingerprint mismatch between {hub.name(rank)} and "
                        f"{hub.name(self._me)}: {', '.join(fields)} differ ({detail})"
                    )
            threads = list({self._owner, threading.current_thread()})
            hub.members[self._me] = (fingerprint, threads)
            hub.cond.notify_all()
            while hub.rejected is None and len(hub.members) < self._topo.world_size:
                if time.monotonic() >= deadline:
                    missing = set(range(self._topo.world_size)) - set(hub.members)
                    names = ", ".join(hub.name(r) for r in sorted(missing))
                    raise AFDTimeoutError(
                        f"timed out after {self._connect_timeout_s}s waiting for "
                        f"{names} to join loopback {self._key}"
                    )
                hub.cond.wait(_POLL_S)
            if hub.rejected is not None:
                raise AFDProtocolError(hub.rejected)
        return Rendezvous(hub.session, "")

    def send_plan(self, plan: StepPlan) -> None:
        hub, peer = self.hub, self._peers[0]
        assert hub is not None
        with hub.cond:
            hub.touch(self._me)
            why = hub.failure(peer)
            if why is not None:
                raise AFDPeerError(
                    f"{hub.name(peer)} {why}; cannot send the plan of step "
                    f"{plan.step_id}"
                )
            hub.plans[(self._me, peer)].append(plan)
            hub.cond.notify_all()

    def recv_plans(self) -> list[StepPlan] | None:
        hub = self.hub
        assert hub is not None
        plans: list[StepPlan] = []
        deadline: float | None = None
        with hub.cond:
            hub.touch(self._me)
            for peer in self._peers:
                queue = hub.plans[(peer, self._me)]
                try:
                    ready = lambda q=queue: bool(q) or self._closed  # noqa: E731
                    hub.wait_for(ready, peer, deadline)
                except AFDTimeoutError:
                    raise AFDTimeoutError(
                        f"timed out after {self._timeout_s}s waiting for the plan "
                        f"of step {plans[0].step_id} from {hub.name(peer)}"
                    ) from None
                except AFDPeerError as e:
                    raise AFDPeerError(
                        f"{e} while this ffn rank waited for its next step plan"
                    ) from None
                if self._closed:
                    return None
                item = queue.popleft()
                if isinstance(item, _Shutdown):
                    return None
                plans.append(item)
                deadline = deadline or time.monotonic() + self._timeout_s
        return plans

    def peer_failure(self, peer: int) -> str | None:
        hub = self.hub
        if hub is None:
            return None
        with hub.cond:
            return hub.failure(peer)

    def close(self, reason: str = "closed") -> None:
        hub = self.hub
        if self._closed or hub is None:
            self._closed = True
            return
        with hub.cond:
            self._closed = True
            hub.closed[self._me] = reason
            for peer in self._peers:
                hub.plans[(self._me, peer)].append(_Shutdown(reason))
            hub.cond.notify_all()
            done = len(hub.closed) >= self._topo.world_size
        if done:
            with _HUBS_LOCK:
                if _HUBS.get(hub.key) is hub:
                    del _HUBS[hub.key]


class _DoneWork(Work):
    def wait(self, timeout_s: float) -> None:
        return None


class _RecvWork(Work):
    def __init__(self, hub: _Hub, src: int, dst: int, tag: int, out: torch.Tensor):
        self._hub, self._src, self._dst, self._tag, self._out = hub, src, dst, tag, out

    def wait(self, timeout_s: float) -> None:
        hub = self._hub
        with hub.cond:
            # Looked up under the lock: a lookup that inserts the key races
            # with isend's (a collection run inside the insertion lets
            # another thread in), and the message lands in the other deque.
            queue = hub.mail[(self._src, self._dst, self._tag)]
            hub.touch(self._dst)
            hub.wait_for(lambda: bool(queue), self._src, time.monotonic() + timeout_s)
            data = queue.popleft()
        if data.shape != self._out.shape or data.dtype != self._out.dtype:
            raise AFDProtocolError(
                f"{hub.name(self._src)} sent {tuple(data.shape)} {data.dtype}, "
                f"expected {tuple(self._out.shape)} {self._out.dtype}"
            )
        self._out.copy_(data)


class LoopbackDataPlane(DataPlane):
    """Tensor moves through the hub of a :class:`LoopbackControlPlane`."""

    def __init__(self, control: LoopbackControlPlane, global_rank: int) -> None:
        self._control, self._me = control, global_rank

    def start(self, rendezvous: Rendezvous) -> None:
        assert self._control.hub is not None

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        hub = self._control.hub
        assert hub is not None
        with hub.cond:
            hub.mail[(self._me, peer, tag)].append(tensor.clone())
            hub.cond.notify_all()
        return _DoneWork()

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        hub = self._control.hub
        assert hub is not None
        return _RecvWork(hub, peer, self._me, tag, tensor)

    def close(self) -> None:
        return None


def build(
    config: AFDConfig,
    role_rank: int,
    fingerprint: Fingerprint,
    device: torch.device,
    topology: Topology,
    extra: dict[str, Any],
    limits: object = None,
) -> AFDConnector:
    """Factory hook for ``loopback``: endpoints meet at ``host:port``
    (``limits`` unused: nothing is sized ahead)."""
    from vllm_afd.connector.connector import AFDConnector

    control = LoopbackControlPlane(
        key=f"{config.host}:{config.port}",
        topology=topology,
        role=config.role,
        role_rank=role_rank,
        timeout_s=extra["timeout_s"],
        connect_timeout_s=extra["connect_timeout_s"],
    )
    data = LoopbackDataPlane(control, topology.global_rank(config.role, role_rank))
    return AFDConnector.assemble(
        "loopback", config, role_rank, topology, fingerprint, device, extra,
        control, data,
    )  # fmt: skip
