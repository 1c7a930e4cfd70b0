"""FFN tensor parallelism: one connector endpoint, every TP rank computes.

Only TP rank 0 of an FFN rank joins the connector. :class:`TPRelay` gives
every TP rank the FFN side of the connector API, so the same
:class:`~vllm_afd.worker.ffn_loop.FFNLoop` runs on all of them::

    TP rank 0 (leader)                    TP rank j > 0 (follower)
    plan = connector.recv_plan()  ──bcast──▶  plan
    batch = connector.recv_a2f()  ──bcast──▶  hidden [ΣT, H] (+ routing)
    out = mlp(hidden)   <── TP all-reduce inside the layer ──>  out
    connector.send_f2a(out)                   (nothing to send)

Broadcasts use vLLM's TP group (objects on its CPU group, tensors on its
device group), from the loop thread; the FFN engine never runs a forward of
its own, so nothing else uses the group concurrently.

When the leader's session ends for a rendezvous again (the deployment
re-forms), the leader broadcasts :class:`Rejoin` instead of a plan: every TP
rank's loop ends with :attr:`TPRelay.rejoining` set, and each starts a new
loop over a new relay once the leader has a new connector (the followers
wait for its first plan).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from vllm_afd.connector.payloads import A2FBatch, ConnectorStats, Routing
from vllm_afd.connector.plan import MergedPlan


class RelayedConnector(Protocol):
    """What the relay needs of the leader's connector (the facade's FFN side,
    ``connector.AFDConnector``)."""

    @property
    def stats(self) -> ConnectorStats: ...

    @property
    def rejoining(self) -> str | None: ...

    def recv_plan(self) -> MergedPlan | None: ...

    def recv_a2f(self, layer_idx: int, ubatch_idx: int) -> A2FBatch: ...

    def send_f2a(
        self, layer_idx: int, ubatch_idx: int, out: torch.Tensor
    ) -> object: ...

    def flush(self) -> None: ...

    def account_graph_step(self) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Rejoin:
    """Broadcast by the leader in place of a plan: its session ended for a
    rendezvous again, for ``why``."""

    why: str


class TPRelay:
    """The FFN connector API over (leader connector + TP broadcasts).

    ``connector`` is the leader's (None on the other TP ranks); ``tp_group``
    vLLM's TP ``GroupCoordinator``."""

    def __init__(
        self,
        connector: RelayedConnector | None,
        tp_group: Any,
        *,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        routing_top_k: int | None = None,
    ) -> None:
        self.connector = connector
        self.tp_group = tp_group
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self.routing_top_k = routing_top_k
        self._plan: MergedPlan | None = None
        self._rejoining: str | None = None
        queue = getattr(tp_group, "mq_broadcaster", None)
        if connector is None and queue is not None and device.type == "cpu":
            _wait_without_spinning(queue)

    @property
    def is_leader(self) -> bool:
        return self.connector is not None

    @property
    def stats(self) -> ConnectorStats:
        return self.connector.stats if self.connector is not None else ConnectorStats()

    @property
    def rejoining(self) -> str | None:
        """Once :meth:`recv_plan` returned None: why the leader's session ended
        for a rendezvous again (every TP rank, the leader too, got it in the
        broadcast); None when the peers shut down for good."""
        return self._rejoining

    def recv_plan(self) -> MergedPlan | None:
        plan: MergedPlan | Rejoin | None = None
        leader = self.connector
        if leader is not None:
            plan = leader.recv_plan()
            why = leader.rejoining if plan is None else None
            plan = Rejoin(why) if why is not None else plan
        plan = self._broadcast_plan(plan)
        if isinstance(plan, Rejoin):
            self._rejoining, plan = plan.why, None
        self._plan = plan
        return plan

    def recv_a2f(self, layer_idx: int, ubatch_idx: int) -> A2FBatch:
        leader = self.connector
        batch = leader.recv_a2f(layer_idx, ubatch_idx) if leader is not None else None
        plan = self._plan
        assert plan is not None  # the loop serves the plan recv_plan returned
        num_tokens = plan.ubatch_tokens[ubatch_idx]
        hidden = self._bcast(
            None if batch is None else batch.hidden,
            (num_tokens, self.hidden_size),
            self.dtype,
        )
        routing = None
        if self.routing_top_k is not None:
            k = self.routing_top_k
            received = None if batch is None else batch.routing
            # the leader's batch carries routing when the gate runs on attention
            assert batch is None or received is not None
            routing = Routing(
                topk_weights=self._bcast(
                    None if received is None else received.topk_weights,
                    (num_tokens, k),
                    torch.float32,
                ),
                topk_ids=self._bcast(
                    None if received is None else received.topk_ids,
                    (num_tokens, k),
                    torch.int32,
                ),
            )
        return A2FBatch(hidden=hidden, routing=routing)

    def _broadcast_plan(
        self, plan: MergedPlan | Rejoin | None
    ) -> MergedPlan | Rejoin | None:
        """The leader's plan on every TP rank. The wait for it lasts as long
        as the deployment is idle, so the other ranks wait without vLLM's
        "No available shared memory broadcast block found in 60 seconds"
        warning (its message queue's indefinite read) where the group has
        one."""
        queue = getattr(self.tp_group, "mq_broadcaster", None)
        if queue is None:
            return self.tp_group.broadcast_object(plan, src=0)
        if self.is_leader:
            queue.enqueue(plan)
            return plan
        return queue.dequeue(indefinite=True)

    def _bcast(
        self, tensor: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        if tensor is None:
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
        return self.tp_group.broadcast(tensor.contiguous(), src=0)

    def send_f2a(self, layer_idx: int, ubatch_idx: int, out: torch.Tensor) -> None:
        if self.connector is not None:
            self.connector.send_f2a(layer_idx, ubatch_idx, out)

    def flush(self) -> None:
        if self.connector is not None:
            self.connector.flush()

    def account_graph_step(self) -> None:
        if self.connector is not None:
            self.connector.account_graph_step()

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()


def _wait_without_spinning(queue: Any) -> None:
    """Make a CPU follower's reads of ``queue`` (the plans) wait asleep.

    vLLM's message queue spins (``sched_yield``) for a second after each read
    before it sleeps until the writer's notification. A follower reads a plan
    every step, so it would spin through the whole step on a core the TP
    ranks compute on. Asleep, it wakes on the leader's notification (a ZeroMQ
    message sent with every write). A GPU rank keeps the spin: it has the
    lower latency, and its compute is not on the CPU.
    """
    condition = getattr(queue, "_spin_condition", None)
    if condition is not None:
        condition.busy_loop_s = 0.0
