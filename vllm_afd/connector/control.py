"""Control plane base: rendezvous, handshake, one plan per step, shutdown.

::

    attention rank a                          ffn rank k = a // r
    ----------------                          -------------------
    start(fp) ---- HELLO / ACCEPT|REJECT ---- start(fp)          (rendezvous)
      setup(0, None) -- SETUP -------------->  setup(i, offer)    (data plane)
      <------------ SETUP (answer) | REJECT --
    send_plan(plan) ------ PLAN ------------> recv_plans() -> [plan per peer]
       ... data plane exchanges for the step ...
    close() ------------- SHUTDOWN ---------> recv_plans() -> None
    peer_failure(k) <---- SHUTDOWN / EOF ---- close() or death

Threading model: one thread (the worker's) calls ``start``, ``send_plan``,
``recv_plans`` and ``peer_failure``; ``close`` may come from any thread and
wakes a ``recv_plans`` blocked in another thread.

Implementor's contract:

* ``start`` blocks at most ``connect_timeout_s``; roles may start in either
  order. A protocol version or fingerprint mismatch raises
  :class:`AFDProtocolError` naming the differing fields on *both* sides.
* ``recv_plans`` is an idle wait: it blocks without a timeout until the first
  peer's plan arrives (an attention role can idle for hours), then waits at
  most ``timeout_s`` for the other peers. A peer that closed its connection or
  died raises :class:`AFDPeerError` promptly; a peer that sent SHUTDOWN makes
  it return None (clean end of service). ``close`` makes it return None.
* ``peer_failure`` never blocks: it reports what is known about a peer
  (SHUTDOWN received, connection lost) so that a data-plane error can say why.
* ``close`` is idempotent, best effort, never raises.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_afd.connector.protocol import Fingerprint, StepPlan


@dataclass(frozen=True)
class Rendezvous:
    """What the data plane needs from a finished handshake.

    Attributes:
        session: id chosen by FFN rank 0, unique per rendezvous.
        local_host: the address of this endpoint that its peers can reach
            ('' when unknown: let the transport pick).
    """

    session: str
    local_host: str
    #: the data-plane setup record of each peer, in peer order
    #: (``DataPlane.setup``); empty where the plane exchanged none
    peer_blobs: tuple[dict[str, Any], ...] = ()


#: ``DataPlane.setup``: (peer index, the peer's record or None) -> own record
SetupFn = Callable[[int, "dict[str, Any] | None"], "dict[str, Any]"]


class ControlPlane(ABC):
    """Per-step metadata between one endpoint and its peers."""

    #: FFN side: why the session ended for a rendezvous again (a member left,
    #: or a peer shut down to rejoin); set before ``recv_plans`` returns None
    reform: str | None = None
    #: FFN side: which served attention rank died (or sent garbage) and how,
    #: when ``rejoin_after_failure`` returned None for that; None otherwise
    gone: str | None = None

    @abstractmethod
    def start(
        self, fingerprint: Fingerprint, setup: SetupFn | None = None
    ) -> Rendezvous:
        """Rendezvous with every endpoint and run the handshake; then swap
        the data plane's records over each peer channel with ``setup``.

        Called by: the facade's ``start``, once, before any other method.
        Raises: AFDProtocolError, AFDTimeoutError, AFDConnectorError.
        """

    @abstractmethod
    def send_plan(self, plan: StepPlan) -> None:
        """Attention: send this step's plan to the serving FFN rank.

        Raises: AFDPeerError if the FFN rank shut down or is gone.
        """

    @abstractmethod
    def recv_plans(self) -> list[StepPlan] | None:
        """FFN: the next plan of every attention peer, in peer order.

        Returns None when a peer sent SHUTDOWN or ``close`` was called.
        Raises: AFDPeerError (peer lost), AFDTimeoutError (a peer lags).
        """

    @abstractmethod
    def peer_failure(self, peer: int) -> str | None:
        """Why connector rank ``peer`` is gone, or None if nothing is known."""

    def peer_stopped(self, peer: int) -> bool:
        """Whether connector rank ``peer`` sent SHUTDOWN for good (a stop,
        not a rejoin); known once ``peer_failure`` read it. The default: no
        plane tells a stop from a loss."""
        return False

    def rejoin_after_failure(self) -> str | None:
        """FFN: once a step failed (a peer error or timeout), why the session
        re-forms, or None when it ends (the FFN rank then stops). Waits a
        bounded time (a few ``timeout_s``) for the served attention ranks
        still connected to leave; sets :attr:`gone` when a served rank died.
        The default: the session ends."""
        return None

    def lost_in(self) -> float:
        """Attention: seconds until the serving FFN rank counts as lost for
        its silence (negative once it does): a data wait never outlasts it.
        The default, for planes without a heartbeat: never."""
        return math.inf

    def watch_peers(self, on_lost: Callable[[int, str], None]) -> None:  # noqa: B027
        """Attention: call ``on_lost(peer, why)`` from a thread of the plane's
        own, once, when the serving FFN rank shuts down or its connection
        drops. Optional: the default watches nothing."""

    @abstractmethod
    def close(self, reason: str = "closed") -> None:
        """Send SHUTDOWN where possible and release sockets. Idempotent."""
