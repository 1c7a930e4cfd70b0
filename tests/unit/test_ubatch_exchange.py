"""The attention exchange in micro-batched steps, over the loopback connector.

Two threads play vLLM's micro-batch threads (one runs at a time and hands
over at ``yield_``, as ``vllm.v1.worker.ubatching`` does); a real FFN loop
serves them. Checked: exact results per micro-batch, one plan carrying both
splits, and the overlap order (micro-batch 1 sends layer L before micro-batch
0 waits for layer L's answer).
"""

from __future__ import annotations

import threading

import pytest
import torch
from test_ffn_loop import HIDDEN, LAYERS, _pair, _start_all

from vllm_afd.connector import ExecMode
from vllm_afd.errors import AFDConnectorError
from vllm_afd.models.exchange import AttentionExchange
from vllm_afd.worker.ffn_loop import FFNLoop


class _HandOff:
    """Micro-batch threads that take turns, like vLLM's UBatchContext."""

    def __init__(self, n: int) -> None:
        self.n, self.turn = n, 0
        self._cv = threading.Condition()
        self._local = threading.local()

    def run(self, index: int, body) -> None:
        self._local.index = index
        with self._cv:
            self._cv.wait_for(lambda: self.turn == index)
        try:
            body()
        finally:
            with self._cv:  # leaving hands over, as UBatchContext.__exit__
                self.turn = (index + 1) % self.n
                self._cv.notify_all()

    def active(self) -> bool:
        return hasattr(self._local, "index")

    def index(self) -> int:
        return self._local.index

    def yield_(self) -> None:
        me = self._local.index
        with self._cv:
            self.turn = (me + 1) % self.n
            self._cv.notify_all()
            self._cv.wait_for(lambda: self.turn == me)


class _Logged:
    """The attention connector, logging the calls the exchange makes."""

    def __init__(self, conn, log: list) -> None:
        self._conn, self._log = conn, log

    def send_a2f(self, layer, ubatch, hidden, routing=None):
        self._log.append(("send", layer, ubatch))
        return self._conn.send_a2f(layer, ubatch, hidden, routing)

    def irecv_f2a(self, layer, ubatch, out=None):
        handle = self._conn.irecv_f2a(layer, ubatch, out=out)
        log = self._log

        class _Wait:
            def wait(self):
                log.append(("received", layer, ubatch))
                return handle.wait()

        return _Wait()

    def __getattr__(self, name):
        return getattr(self._conn, name)


@pytest.fixture
def served():
    ffn, (att,) = _pair()
    _start_all(ffn, att)
    served: list[tuple[int, int]] = []

    def compute(layer_idx, batch):
        served.append((layer_idx, batch.hidden.shape[0]))
        return batch.hidden * 2 + layer_idx

    loop = FFNLoop(ffn, compute, LAYERS, on_exit=lambda e: None)
    loop.start()
    yield att, served, loop
    att.close()
    loop._thread.join(10)
    ffn.close()


def test_micro_batches_exchange_exactly_and_in_overlap_order(served):
    att, ffn_served, loop = served
    log: list = []
    switch = _HandOff(2)
    exchange = AttentionExchange(_Logged(att, log), switch=switch)
    split = (3, 5)
    results: dict[int, bool] = {}

    def micro_batch(i: int) -> None:
        exchange.begin_forward(split[i], ExecMode.EAGER)
        ok = True
        for layer in LAYERS:
            hidden = torch.randn(split[i], HIDDEN)
            ok &= torch.equal(exchange.exchange(hidden, layer), hidden * 2 + layer)
        results[i] = ok

    for _ in range(3):  # steps
        log.clear()
        ffn_served.clear()
        exchange.stage_ubatches(split)
        threads = [
            threading.Thread(target=switch.run, args=(i, lambda i=i: micro_batch(i)))
            for i in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert results == {0: True, 1: True}
        # The FFN served layer by layer, micro-batch by micro-batch.
        assert ffn_served == [(layer, n) for layer in LAYERS for n in split]
        for layer in LAYERS:
            # Micro-batch 1's layer runs while micro-batch 0's is away.
            assert log.index(("send", layer, 1)) < log.index(("received", layer, 0))
    # The FFN counts a step after its last send: end the loop before reading.
    att.close()
    loop._thread.join(10)
    assert att.stats.steps == 3 and loop.stats.ubatched_steps == 3


def test_micro_batch_zero_refuses_a_split_the_runner_did_not_stage(served):
    att, _, _ = served
    switch = _HandOff(2)
    exchange = AttentionExchange(att, switch=switch)
    errors: list[BaseException] = []

    def first() -> None:
        try:
            exchange.begin_forward(4, ExecMode.EAGER)
        except AFDConnectorError as e:
            errors.append(e)

    thread = threading.Thread(target=switch.run, args=(0, first))
    thread.start()
    thread.join(10)
    assert errors and "staged None" in str(errors[0])
