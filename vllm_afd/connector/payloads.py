"""Local records of the connector: tensors, handles, counters.

Dimensions: T tokens of one attention rank's ubatch, ΣT tokens of an FFN
rank's merged ubatch, H hidden size, K top-k.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vllm_afd.connector.data import Work


@dataclass(frozen=True)
class Routing:
    """Router output computed on attention (``compute_gate_on_attention``).

    Attributes:
        topk_weights: ``[T, K]`` float32, weight of each chosen expert.
        topk_ids: ``[T, K]`` int32, global index of each chosen expert.
    """

    topk_weights: torch.Tensor
    topk_ids: torch.Tensor

    def to(self, device: torch.device | str) -> Routing:
        """The same routing on ``device`` (tensors already there kept)."""
        return Routing(self.topk_weights.to(device), self.topk_ids.to(device))


@dataclass(frozen=True)
class A2FBatch:
    """What an FFN rank computes on for one (layer, ubatch).

    Attributes:
        hidden: ``[ΣT, H]`` activation dtype, the peers' tokens concatenated
            in peer order (see ``plan``).
        routing: ``[ΣT, K]`` routing when the gate runs on attention, else None.

    The tensors are connector buffers: valid until the next ``recv_a2f`` of
    the same ubatch_idx. Clone them to keep them longer.
    """

    hidden: torch.Tensor
    routing: Routing | None

    def to(self, device: torch.device | str) -> A2FBatch:
        """The same batch on ``device`` (tensors already there kept)."""
        routing = None if self.routing is None else self.routing.to(device)
        return A2FBatch(self.hidden.to(device), routing)


@dataclass(frozen=True)
class ConnectorStats:
    """A snapshot of one endpoint's counters since ``start``.

    Attributes:
        steps: plans sent (attention) or merged plans received (FFN).
        a2f_bytes: bytes of A2F payload sent (attention) or received (FFN).
        f2a_bytes: bytes of F2A payload received (attention) or sent (FFN).
        wait_s: host seconds spent blocked in data-plane waits.
        errors: connector errors raised to the caller.
    """

    steps: int = 0
    a2f_bytes: int = 0
    f2a_bytes: int = 0
    wait_s: float = 0.0
    errors: int = 0


# (work, peer connector rank, ExchangeKey.tag, is_send): decoded only on error.
Pending = tuple[Work, int, int, bool]
WaitFn = Callable[[Sequence[Pending]], None]


class SendHandle:
    """An A2F or F2A send in flight: ``h = conn.send_a2f(...); ...; h.wait()``.

    The sent tensors must stay untouched until ``wait`` returns. A handle that
    is never waited is waited by the connector at the next step boundary.
    """

    __slots__ = ("_pending", "_wait_fn")

    def __init__(self, pending: Sequence[Pending], wait_fn: WaitFn) -> None:
        self._pending: Sequence[Pending] | None = pending
        self._wait_fn = wait_fn

    @property
    def done(self) -> bool:
        """True once ``wait`` has returned (or nothing was sent)."""
        return not self._pending

    def wait(self) -> None:
        """Block until the peer has the data (at most the connector timeout).

        Raises: AFDTimeoutError, AFDPeerError naming peer, step, layer, ubatch.
        """
        if self._pending:
            pending, self._pending = self._pending, None
            self._wait_fn(pending)


class RecvHandle:
    """An F2A receive in flight: ``h = conn.irecv_f2a(...); out = h.wait()``."""

    __slots__ = ("_before", "_copy_to", "_pending", "_result", "_wait_fn")

    def __init__(
        self,
        pending: Sequence[Pending],
        result: torch.Tensor,
        wait_fn: WaitFn,
        copy_to: torch.Tensor | None = None,
    ) -> None:
        self._pending: Sequence[Pending] | None = pending
        self._result = result
        self._wait_fn = wait_fn
        self._copy_to = copy_to
        self._before: SendHandle | None = None  # waited first, if set

    @property
    def done(self) -> bool:
        return not self._pending

    def wait(self) -> torch.Tensor:
        """The received ``[T, H]`` output, once it has arrived.

        Raises: AFDTimeoutError, AFDPeerError naming peer, step, layer, ubatch.
        """
        if self._pending:
            if self._before is not None:
                self._before.wait()
            pending, self._pending = self._pending, None
            self._wait_fn(pending)
            if self._copy_to is not None:
                self._result = self._copy_to.copy_(self._result)
        return self._result
