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
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from vllm_afd.connector.control import Rendezvous


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

    def prepare(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Bind what peers will connect to; called before the handshake."""

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
