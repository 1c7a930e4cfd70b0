"""TPRelay's object channel: how the FFN TP ranks learn that the leader's
session ended, and why (a rendezvous again, or the peers shut down)."""

from __future__ import annotations

import queue
import threading
import time

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


class _QueueGroup:
    """A TP group whose objects go through vLLM's shared-memory message queue
    (its ``mq_broadcaster``), as the FFN engine's TP group has one."""

    def __init__(self, mq) -> None:
        self.mq_broadcaster = mq


def test_a_cpu_follower_waits_for_the_next_plan_asleep() -> None:
    """Between two plans a follower on CPU sleeps (vLLM's queue would spin a
    second after each read, on a core the TP ranks compute on): the thread
    spends far less CPU time than the wait lasts."""
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    writer = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    ready = threading.Thread(target=reader.wait_until_ready)
    ready.start()
    writer.wait_until_ready()
    ready.join(timeout=10)
    kw = {"hidden_size": 4, "dtype": torch.float32, "device": torch.device("cpu")}
    leader = TPRelay(_Leader(["plan 1", "plan 2"], None), _QueueGroup(writer), **kw)
    follower = TPRelay(None, _QueueGroup(reader), **kw)
    seen: dict = {}

    def follow() -> None:
        seen["first"] = follower.recv_plan()
        start = time.thread_time()
        seen["second"] = follower.recv_plan()
        seen["cpu_s"] = time.thread_time() - start

    thread = threading.Thread(target=follow)
    thread.start()
    assert leader.recv_plan() == "plan 1"
    time.sleep(IDLE_S)  # the deployment idle between two steps
    assert leader.recv_plan() == "plan 2"
    thread.join(timeout=10)
    assert seen["first"] == "plan 1" and seen["second"] == "plan 2"
    assert seen["cpu_s"] < IDLE_S / 4, seen


#: how long the leader holds the second plan back
IDLE_S = 1.0
