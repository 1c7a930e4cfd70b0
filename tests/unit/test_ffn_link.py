"""The attention rank's FFN link: lost, served zeros, rejoined (loopback, no vLLM).

A real FFN loop serves the attention exchange over the in-process loopback
connector; the FFN endpoint closes mid-run, and ``reconnect`` brings up a new
FFN endpoint on another port, as a restarted FFN rank would be.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_ffn_loop import LAYERS, _compute, _pair, _start_all

from vllm_afd.errors import AFDConnectorError, AFDProtocolError
from vllm_afd.models.exchange import AttentionExchange
from vllm_afd.worker import ffn_link
from vllm_afd.worker.ffn_link import FFNLink
from vllm_afd.worker.ffn_loop import FFNLoop


def _served_pair():
    """A started (FFN loop, attention connector) pair."""
    ffn, (att,) = _pair()
    _start_all(ffn, att)
    loop = FFNLoop(ffn, _compute, LAYERS)
    loop.start()
    return loop, att


def _step(exchange: AttentionExchange, tokens: int = 3) -> list[torch.Tensor]:
    """One step through every layer: (sent, received) per layer."""
    exchange.failure = None
    exchange.begin_step(tokens)
    out = []
    for layer in LAYERS:
        hidden = torch.randn(tokens, 8)
        out.append((hidden, exchange.exchange(hidden, layer)))
    return out


def _closes(connector) -> list[bool]:
    """Record ``connector``'s close calls in the returned list."""
    closed: list[bool] = []
    close = connector.close
    connector.close = lambda *a: (closed.append(True), close(*a))
    return closed


def _served_then_closed(
    link: FFNLink, exchange: AttentionExchange, loops, through=None
) -> None:
    """A step through ``link`` (its connector ``through``, if given) is
    served exactly; then everything stops."""
    for layer, (hidden, got) in zip(LAYERS, _step(exchange), strict=True):
        assert torch.equal(got, _compute(layer, _Batch(hidden)))
    assert exchange.failure is None
    assert through is None or link.connector is through
    link.close()
    for each in loops:
        each.stop()


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.01)


def test_a_lost_ffn_rank_serves_zeros_fails_the_step_and_rejoins(monkeypatch):
    monkeypatch.setattr(ffn_link, "RETRY_S", 0.01)
    loop, att = _served_pair()
    loops = [loop]
    states = []

    def reconnect():
        new_loop, new_att = _served_pair()
        loops.append(new_loop)
        return new_att

    link = FFNLink(att, reconnect, attention_rank=0, ffn_rank=0, publish=states.append)
    exchange = AttentionExchange(None, link=link)
    for layer, (hidden, got) in zip(LAYERS, _step(exchange), strict=True):
        assert torch.equal(got, _compute(layer, _Batch(hidden)))
    assert exchange.failure is None and link.state.up

    loop.stop()  # the FFN rank goes away (its connector closes)
    results = _step(exchange)
    assert exchange.failure is not None, "a step without its FFN rank passed"
    assert all(torch.count_nonzero(got) == 0 for _, got in results[1:])
    _wait(lambda: link.state.up)  # rejoined through reconnect()
    assert link.state.losses == 1 and link.state.rejoins == 1
    assert [s.up for s in states] == [True, False, True]
    assert states[1].why == exchange.failure or states[1].why in exchange.failure

    for layer, (hidden, got) in zip(LAYERS, _step(exchange), strict=True):
        assert torch.equal(got, _compute(layer, _Batch(hidden)))
    assert exchange.failure is None
    link.close()
    for each in loops:
        each.stop()


class _Batch:
    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden


def test_steps_while_down_fail_at_once_and_a_refused_rank_is_retried(monkeypatch):
    monkeypatch.setattr(ffn_link, "RETRY_S", 0.01)
    loop, att = _served_pair()
    attempts: list[str] = []
    release = threading.Event()
    loops = [loop]

    def reconnect():
        if not release.is_set():
            attempts.append("refused")
            raise AFDProtocolError("fingerprint mismatch: model_digest")
        new_loop, new_att = _served_pair()
        loops.append(new_loop)
        return new_att

    link = FFNLink(att, reconnect, attention_rank=0, ffn_rank=0)
    exchange = AttentionExchange(None, link=link)
    link.lost("ffn rank 0 closed its connection")
    link.lost("ffn rank 0 closed its connection")  # idempotent while down
    assert not link.state.up and link.state.losses == 1
    _wait(lambda: len(attempts) >= 3)  # refused, retried, still waiting
    assert not link.state.up
    start = time.monotonic()
    results = _step(exchange)
    assert time.monotonic() - start < 1.0  # no wait for a missing rank
    assert exchange.failure == "ffn rank 0 closed its connection"
    assert all(torch.count_nonzero(got) == 0 for _, got in results)
    release.set()
    _wait(lambda: link.state.up)
    for layer, (hidden, got) in zip(LAYERS, _step(exchange), strict=True):
        assert torch.equal(got, _compute(layer, _Batch(hidden)))
    link.close()
    link.lost("after close")  # nothing happens after close()
    assert link.state.up
    for each in loops:
        each.stop()


def test_without_a_link_a_connector_error_still_raises():
    loop, att = _served_pair()
    exchange = AttentionExchange(att)
    _step(exchange)
    loop.stop()
    with pytest.raises(Exception, match="ffn rank 0"):
        _step(exchange)
    att.close()


def test_a_rejoined_connector_resumes_before_any_step_uses_it(monkeypatch):
    """``resume()`` (cuda_ipc: zero the state its graphs point at) runs once
    per rejoin, while the link is still down and no step can start."""
    monkeypatch.setattr(ffn_link, "RETRY_S", 0.01)
    loop, att = _served_pair()
    # Built by this thread, which lives on: a loopback endpoint whose
    # threads all ended counts as exited (the rejoin thread ends first).
    new_loop, new_att = _served_pair()
    loops, seen = [loop, new_loop], []

    def reconnect():
        def resume() -> None:
            entered = threading.Event()

            def step() -> None:
                with link.step():
                    entered.set()

            t = threading.Thread(target=step)
            t.start()
            seen.append((link.state.up, entered.wait(0.2)))
            new_att.resumed = True

        new_att.resume = resume
        return new_att

    link = FFNLink(att, reconnect, attention_rank=0, ffn_rank=0)
    exchange = AttentionExchange(None, link=link)
    link.lost("ffn rank 0 closed its connection")
    _wait(lambda: link.state.up)
    assert seen == [(False, False)], "resumed while up, or beside a step"
    assert link.connector.resumed
    for layer, (hidden, got) in zip(LAYERS, _step(exchange), strict=True):
        assert torch.equal(got, _compute(layer, _Batch(hidden)))
    link.close()
    for each in loops:
        each.stop()


def test_a_connector_that_fails_to_resume_is_closed_and_the_rendezvous_retried(
    monkeypatch,
):
    monkeypatch.setattr(ffn_link, "RETRY_S", 0.01)
    loop, att = _served_pair()
    bad_loop, bad = _served_pair()
    good_loop, good = _served_pair()

    def refuse() -> None:
        raise AFDConnectorError("the data plane failed before its first step")

    bad.resume = refuse
    closed = _closes(bad)
    offers = iter([bad, good])
    link = FFNLink(att, lambda: next(offers), attention_rank=0, ffn_rank=0)
    exchange = AttentionExchange(None, link=link)
    link.lost("ffn rank 0 closed its connection")
    _wait(lambda: link.state.up)
    assert closed and link.connector is good and link.state.rejoins == 1
    _served_then_closed(link, exchange, (loop, bad_loop, good_loop))


def test_an_aligned_link_exchanges_again_only_in_a_forward_every_rank_voted_for(
    monkeypatch,
):
    """With data parallelism a rejoined link reports up at once (the API
    admits requests) but exchanges only from the first forward whose vote
    (``decided``, from vLLM's per-forward DP all-reduce) says every rank is
    back: all ranks go live in the same forward."""
    monkeypatch.setattr(ffn_link, "RETRY_S", 0.01)
    loop, att = _served_pair()
    new_loop, new_att = _served_pair()
    link = FFNLink(att, lambda: new_att, attention_rank=0, ffn_rank=0, aligned=True)
    exchange = AttentionExchange(None, link=link)
    assert link.vote()
    link.lost("ffn rank 0 closed its connection")
    _wait(lambda: link.state.up)
    assert link.vote() and link.waiting_for_ranks and link.connector is None
    for vote in (None, False):  # no vote yet, then another rank not back
        if vote is not None:
            link.decided(vote)
        results = _step(exchange)
        assert all(torch.count_nonzero(got) == 0 for _, got in results)
        assert "rejoined; the data-parallel ranks exchange again" in exchange.failure
        assert link.waiting_for_ranks
    link.decided(True)  # the next forward activates it
    _served_then_closed(link, exchange, (loop, new_loop), through=new_att)
    assert link.state.rejoins == 1


def test_an_aligned_link_lost_again_before_its_forward_closes_the_staged_one(
    monkeypatch,
):
    monkeypatch.setattr(ffn_link, "RETRY_S", 0.01)
    loop, att = _served_pair()
    staged_loop, staged = _served_pair()
    good_loop, good = _served_pair()
    closed = _closes(staged)
    offers = iter([staged, good])
    link = FFNLink(
        att, lambda: next(offers), attention_rank=0, ffn_rank=0, aligned=True
    )
    exchange = AttentionExchange(None, link=link)
    link.lost("ffn rank 0 closed its connection")
    _wait(lambda: link.state.up)
    link.lost("ffn rank 0 sent no heartbeat for 4.0s")
    _wait(lambda: link.state.up and link.state.rejoins == 2)
    assert closed, "the staged connector was left open"
    link.decided(True)
    _served_then_closed(link, exchange, (loop, staged_loop, good_loop), through=good)
