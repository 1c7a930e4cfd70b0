"""TPRelay's object channel: how the FFN TP ranks learn that the leader's
session ended, and why (a rendezvous again, or the peers shut down)."""

from __future__ import annotations

import queue

import torch

from vllm_afd.worker.tp_relay import Rejoin, TPRelay


class _Group:
    """Two TP ranks' object broadcast over one queue (src 0 puts, 1 gets)."""

    def __init__(self, channel: queue.Queue, rank: int) -> None:
        self.channel, self.rank = channel, rank

    def broadcast_object(self, obj, src: int = 0):
        if self.rank == src:
            self.channel.put(obj)
            return obj
        return self.channel.get(timeout=5)


class _Leader:
    """A connector whose session ends (for ``why``) after ``plans``."""

    def __init__(self, plans: list, why: str | None) -> None:
        self.plans, self.why, self.rejoining = plans, why, None

    def recv_plan(self):
        if self.plans:
            return self.plans.pop(0)
        self.rejoining = self.why
        return None


def _pair(connector: _Leader) -> tuple[TPRelay, TPRelay]:
    channel: queue.Queue = queue.Queue()
    kw = {"hidden_size": 4, "dtype": torch.float32, "device": torch.device("cpu")}
    return (
        TPRelay(connector, _Group(channel, 0), **kw),
        TPRelay(None, _Group(channel, 1), **kw),
    )


def test_a_rendezvous_again_reaches_every_tp_rank_with_its_reason() -> None:
    leader, follower = _pair(_Leader(["plan"], "ffn rank 1 left"))
    assert leader.recv_plan() == "plan" and follower.recv_plan() == "plan"
    assert leader.rejoining is None and follower.rejoining is None
    assert leader.recv_plan() is None and follower.recv_plan() is None
    assert leader.rejoining == follower.rejoining == "ffn rank 1 left"


def test_peers_shutting_down_ends_every_tp_rank_without_a_rejoin() -> None:
    leader, follower = _pair(_Leader([], None))
    assert leader.recv_plan() is None and follower.recv_plan() is None
    assert leader.rejoining is None and follower.rejoining is None
    assert Rejoin("x") == Rejoin("x")  # picklable value: crosses processes
