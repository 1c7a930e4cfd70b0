"""Data plane base: point-to-point tensor moves keyed by exchange identity.

Dimensions: T tokens, H hidden size, K top-k (see ``protocol``).

::

    sender                                   receiver
    ------                                   --------
    w = isend(t, peer, tag) ---- bytes ----> w = irecv(buf, peer, tag)
    w.wait(timeout_s)                        w.wait(timeout_s)  # buf now valid

The data plane knows nothing about requests, plans or roles: the facade
slices and merges, then asks for single contiguous tensor moves. ``tag`` is
the 31-bit ``ExchangeKey.tag`` of (step, layer, ubatch, kind) and must match
on both sides; a receive never consumes a message sent under another tag.

Threading model: all methods are called from the worker thread, except
``close`` which may come from any thread.

Implementor's contract:

* ``prepare`` runs before the handshake (bind listening ports there, so that
  a port in use fails fast), ``start`` after it.
* ``isend``/``irecv`` never block on the peer; they return a :class:`Work`.
* ``Work.wait(timeout_s)`` blocks at most ``timeout_s`` (on CUDA it only
  orders the current stream and does not block the host). It raises
  :class:`AFDTimeoutError` (ran out) or :class:`AFDPeerError` (connection
  lost) with the transport's detail; the facade rewrites the message to name
  the peer, step, layer and ubatch.
* A sent tensor must stay untouched until its ``Work`` completes; a receive
  buffer is valid once its ``Work.wait`` returns.
* After any error the plane may be unusable; the facade stops using it.
* ``close`` is idempotent and frees the transport (process group).
* ``setup(peer, theirs)`` runs during the handshake, once per peer, in the
  worker thread: an attention endpoint is asked with ``theirs=None`` for its
  offer, the FFN endpoint answers each offer; ``start`` then finds the peers'
  records in ``Rendezvous.peer_blobs``. Records are JSON objects. The FFN
  side refuses a peer whose ``backend`` differs (the handshake then fails on
  both sides with that message).
* ``check()`` is cheap and non-blocking; the facade calls it once per step,
  once the device finished the step's exchanges (planes whose waits run on
  the device report their failures there). ``abort()`` may come from any
  thread: device-side waits end at once (with an error ``check`` reports).
* ``capabilities`` says what the plane guarantees (:class:`Capabilities`):
  the facade refuses to capture a step on a plane that is not
  ``graph_capturable``, warns at start-up about one that does not
  ``matches_tags``, and tells the attention worker whether its waits are
  ``bounded_wait`` (else a lost FFN rank stops the engine).
* ``resume()`` is called once, by an attention rank that rejoined an FFN
  rank, after ``start`` and before the first step on this plane, while no
  step runs: a plane that keeps device state across planes of one process
  (cuda_ipc: what CUDA graphs point at) makes it new there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vllm_afd.connector.control import Rendezvous
from vllm_afd.errors import AFDProtocolError


@dataclass(frozen=True)
class Capabilities:
    """What a data plane guarantees.

    Attributes:
        graph_capturable: its moves may be captured in a CUDA graph.
        matches_tags: a receive never returns the bytes of another exchange
            (Gloo matches tags; cuda_ipc checks a sequence number on the
            device and reports a mismatch); NCCL pairs by order only.
        bounded_wait: a wait for a peer that is gone ends within the timeout,
            also inside a CUDA graph replay (NCCL's device-side waits do not).
    """

    graph_capturable: bool
    matches_tags: bool
    bounded_wait: bool


class Work(ABC):
    """One pending tensor move."""

    @abstractmethod
    def wait(self, timeout_s: float) -> None:
        """Block until done, at most ``timeout_s`` seconds."""


class DataPlane(ABC):
    """Tensor moves between connector ranks (FFN ranks first)."""

    #: Receives are much faster when posted before the matching send leaves the
    #: peer (Gloo: an unexpected message takes a slow path), and posting early
    #: cannot deadlock (no stream ordering). The facade then posts the F2A
    #: receive of a (layer, ubatch) before sending its A2F.
    prepost_recv: bool = False
    #: the name ``connector_extra_config.backend`` gives it
    backend: str = ""
    capabilities = Capabilities(
        graph_capturable=False, matches_tags=True, bounded_wait=True
    )

    def prepare(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Bind what peers will connect to; called before the handshake."""

    def setup(self, peer: int, theirs: Mapping[str, Any] | None) -> dict[str, Any]:
        """This endpoint's record for peer index ``peer`` (see the contract).

        Raises: AFDProtocolError (the peer's record does not fit this plane),
        AFDConfigError (the pair cannot use this plane here).
        """
        if theirs is not None:
            check_backend(self.backend, theirs)
        return {"backend": self.backend}

    def check(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Raise what the device reported since the last call (see contract)."""

    def abort(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """End every device-side wait now; any thread."""

    def resume(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Before the first step after a rejoin (see the contract)."""

    @abstractmethod
    def start(self, rendezvous: Rendezvous) -> None:
        """Join the transport; called once, after the handshake."""

    @abstractmethod
    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        """Start sending contiguous ``tensor`` to connector rank ``peer``."""

    @abstractmethod
    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        """Start receiving into contiguous ``tensor`` from connector rank ``peer``."""

    @abstractmethod
    def close(self) -> None:
        """Free the transport. Idempotent, never raises."""


def check_backend(mine: str, theirs: Mapping[str, Any]) -> None:
    """AFDProtocolError unless the peer's setup record names backend ``mine``."""
    other = theirs.get("backend") if isinstance(theirs, Mapping) else None
    if other != mine:
        raise AFDProtocolError(
            f"the attention rank's data plane is {other!r}, the FFN rank's is "
            f"{mine!r}: set the same afd.connector_extra_config.backend on both "
            "roles"
        )
