"""Contract suite: every registered connector behaves the same.

``loopback`` endpoints run as threads, ``p2p`` endpoints as processes (so a
peer can be SIGKILLed). Programs and runner: ``_scenarios.py``.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _scenarios as S  # noqa: E402

from vllm_afd.connector import (  # noqa: E402
    ExecMode,
    StepPlan,
    registered_names,
)
from vllm_afd.connector.factory import spec  # noqa: E402
from vllm_afd.errors import (  # noqa: E402
    AFDConnectorError,
    AFDPeerError,
    AFDProtocolError,
    AFDTimeoutError,
)

#: the synchronous connectors (``async`` has its own suite: test_async.py)
CONNECTORS = tuple(n for n in registered_names() if not spec(n).asynchronous)
TOPOLOGIES = [(1, 1), (2, 1), (2, 2), (4, 2), (3, 2)]


def _ok(results: dict) -> None:
    bad = {ep: r for ep, r in results.items() if not r.get("ok")}
    assert not bad, bad


@pytest.mark.parametrize("connector", CONNECTORS)
@pytest.mark.parametrize("num_ubatches", [1, 2])
@pytest.mark.parametrize("topo", TOPOLOGIES, ids=lambda t: f"{t[0]}A{t[1]}F")
def test_round_trip_exact_all_topologies(connector, topo, num_ubatches):
    a, f = topo
    sc = S.Scenario(connector, S.free_port(), a, f, num_ubatches=num_ubatches)
    results = S.run(sc)
    _ok(results)
    for rank in range(a):
        assert results[("attention", rank)]["steps"] == sc.steps
    for rank in range(f):
        assert results[("ffn", rank)]["steps"] == sc.steps


def test_loopback_loses_no_message_when_threads_switch_anywhere():
    """4A2F loopback, its six threads switched every microsecond and a
    collection (with a callback: Python code, so another thread may run)
    at every allocation. A mailbox looked up outside the hub's lock once let
    a receiver's insertion overwrite the deque a sender had just filled: the
    message was lost and its step waited its whole timeout (within about 30
    runs here)."""
    import gc

    def callback(phase: str, info: dict) -> None:
        sum(range(20))

    switch, threshold = sys.getswitchinterval(), gc.get_threshold()
    gc.callbacks.append(callback)
    gc.set_threshold(1, 1, 1)
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(100):
            sc = S.Scenario("loopback", S.free_port(), 4, 2, timeout_s=5.0)
            _ok(S.run(sc, limit_s=20.0))
    finally:
        gc.callbacks.remove(callback)
        gc.set_threshold(*threshold)
        sys.setswitchinterval(switch)


@pytest.mark.parametrize("connector", CONNECTORS)
def test_round_trip_routing_bf16_with_gate_on_attention(connector):
    sc = S.Scenario(
        connector, S.free_port(), 2, 1, num_ubatches=2, dtype="bfloat16",
        gate_on_attention=True,
    )  # fmt: skip
    _ok(S.run(sc))


@pytest.mark.parametrize("connector", CONNECTORS)
def test_zero_token_ranks_skip_their_transfers(connector):
    sc = S.Scenario(
        connector, S.free_port(), 4, 2, num_ubatches=2, steps=4, zero_ranks=(0, 3)
    )
    _ok(S.run(sc))


@pytest.mark.parametrize("connector", CONNECTORS)
def test_fingerprint_mismatch_fails_both_sides_naming_field(connector):
    sc = S.Scenario(
        connector, S.free_port(), 1, 1,
        fp_override={("attention", 0): {"top_k": 4}},
    )  # fmt: skip
    results = S.run(sc)
    for ep in S.endpoints(sc):
        assert results[ep]["error"] == "AFDProtocolError", results
        assert "top_k" in results[ep]["message"]


@pytest.mark.parametrize("connector", CONNECTORS)
@pytest.mark.parametrize("victim", ["ffn", "attention"])
def test_peer_killed_mid_step_survivor_errors_within_timeout(connector, victim):
    sc = S.Scenario(
        connector, S.free_port(), 2, 1, num_ubatches=2, timeout_s=5.0,
        die_at=(victim, 0 if victim == "ffn" else 1, 1, 1),
    )  # fmt: skip
    t0 = time.monotonic()
    results = S.run(sc, limit_s=30)
    assert time.monotonic() - t0 < 25
    dead = ("ffn", 0) if victim == "ffn" else ("attention", 1)
    assert results[dead].get("killed"), results
    survivors = [ep for ep in S.endpoints(sc) if ep != dead]
    for ep in survivors:
        r = results[ep]
        assert r.get("error") in ("AFDPeerError", "AFDTimeoutError"), results
        assert r["elapsed"] < sc.timeout_s + 3
    # The FFN names the dead attention rank and where it waited: the victim
    # posted layer 1 before dying (it may not have left the process).
    if victim == "attention":
        msg = results[("ffn", 0)]["message"]
        assert re.search(
            r"a2f from attention rank 1 \(step 1, layer [12], ubatch [01]\)", msg
        )


@pytest.mark.parametrize("connector", CONNECTORS)
def test_shutdown_from_ffn_unblocks_attention(connector):
    sc = S.Scenario(connector, S.free_port(), 2, 1, steps=5, ffn_stop_after=2)
    results = S.run(sc)
    assert results[("ffn", 0)] == {"ok": True, "steps": 2, "stats_steps": 2}
    for rank in range(2):
        r = results[("attention", rank)]
        # inside a step p2p tells a stop from a loss (AFDPeerStopped)
        assert r["error"] in ("AFDPeerError", "AFDPeerStopped"), r
        assert "shut down" in r["message"], r


# ---------------------------------------------------------------------------
# In-process checks (threads), identical for every connector.


def _pair(connector: str, timeout_s: float = 5.0):
    port = S.free_port()
    sc = S.Scenario(connector, port, 1, 1, timeout_s=timeout_s)
    att, ffn = S._connector(sc, "attention", 0), S._connector(sc, "ffn", 0)
    # The FFN starts on this thread, which then drives both endpoints.
    t = threading.Thread(target=att.start)
    t.start()
    ffn.start()
    t.join()
    return sc, att, ffn


@pytest.mark.parametrize("connector", CONNECTORS)
def test_wrong_role_call_raises_at_once(connector):
    sc = S.Scenario(connector, S.free_port(), 1, 1)
    att = S._connector(sc, "attention", 0)
    with pytest.raises(AFDConnectorError, match="ffn-role call"):
        att.recv_plan()
    ffn = S._connector(sc, "ffn", 0)
    with pytest.raises(AFDConnectorError, match="attention-role call"):
        ffn.send_a2f(0, 0, torch.zeros(1, sc.hidden))
    with pytest.raises(AFDConnectorError, match="not started"):
        ffn.recv_plan()


@pytest.mark.parametrize("connector", CONNECTORS)
def test_close_from_other_thread_ends_idle_plan_wait(connector):
    _, att, ffn = _pair(connector, timeout_s=0.3)
    got: list = []
    t = threading.Thread(target=lambda: got.append(ffn.recv_plan()))
    t.start()
    time.sleep(0.6)  # longer than timeout_s: an idle wait must not time out
    assert t.is_alive()
    ffn.close()
    t.join(2)
    assert not t.is_alive() and got == [None]
    with pytest.raises(AFDPeerError, match="shut down"):
        att.send_plan(StepPlan(0, ExecMode.EAGER, (1,)))
    att.close()


@pytest.mark.parametrize("connector", CONNECTORS)
def test_attention_close_makes_recv_plan_return_none(connector):
    _, att, ffn = _pair(connector)
    att.close()
    assert ffn.recv_plan() is None
    ffn.close()
    ffn.close()


@pytest.mark.parametrize("connector", CONNECTORS)
def test_tensor_not_matching_plan_is_rejected_before_sending(connector):
    sc, att, ffn = _pair(connector)
    att.send_plan(StepPlan(0, ExecMode.EAGER, (3,)))
    with pytest.raises(AFDProtocolError, match=r"expect \(3, 16\) torch.float32"):
        att.send_a2f(0, 0, torch.zeros(2, sc.hidden))
    with pytest.raises(AFDProtocolError, match="float32"):
        att.send_a2f(0, 0, torch.zeros(3, sc.hidden, dtype=torch.float64))
    with pytest.raises(AFDConnectorError, match="ubatch_idx=1"):
        att.send_a2f(0, 1, torch.zeros(3, sc.hidden))
    with pytest.raises(AFDConnectorError, match="routing"):
        att.send_a2f(0, 0, torch.zeros(3, sc.hidden), routing=object())
    att.close()
    ffn.close()


@pytest.mark.parametrize("connector", CONNECTORS)
def test_stats_and_async_handles(connector):
    sc, att, ffn = _pair(connector)
    att.send_plan(StepPlan(0, ExecMode.WARMUP, (4,)))
    plan = ffn.recv_plan()
    assert plan.mode is ExecMode.WARMUP and plan.ubatch_tokens == (4,)
    hidden = torch.arange(4 * sc.hidden, dtype=torch.float32).view(4, sc.hidden)
    h = att.send_a2f(1, 0, hidden)
    batch = ffn.recv_a2f(1, 0)
    sh = ffn.send_f2a(1, 0, batch.hidden + 1)
    out = att.irecv_f2a(1, 0).wait()
    h.wait()
    sh.wait()
    assert h.done and sh.done and torch.equal(out, hidden + 1)
    nbytes = 4 * sc.hidden * 4
    assert att.stats.steps == 1 and att.stats.a2f_bytes == nbytes
    assert att.stats.f2a_bytes == nbytes and ffn.stats.f2a_bytes == nbytes
    att.close()
    assert ffn.recv_plan() is None
    ffn.close()


#: Steps whose waits may last warmup_timeout_s, then the step that must wait
#: timeout_s: the first served step (its shapes run for the first time:
#: lazily built kernels) and the step after it; a WARMUP step before the first
#: served step (profile, compile) and a WARMUP step after a served one (an idle
#: data-parallel rank's dummy forward).
SLOW_THEN_FAST = {
    "first-served-step": ((ExecMode.EAGER,), ExecMode.EAGER),
    "dummy-after-served": ((ExecMode.WARMUP, ExecMode.EAGER), ExecMode.WARMUP),
}


@pytest.mark.parametrize("steps", SLOW_THEN_FAST.values(), ids=SLOW_THEN_FAST)
@pytest.mark.parametrize("connector", CONNECTORS)
def test_which_steps_wait_up_to_warmup_timeout_s(connector, steps):
    slow, fast = steps
    sc = S.Scenario(connector, S.free_port(), 1, 1, timeout_s=0.3)
    limits = {"warmup_timeout_s": 3.0}
    att = S._connector(sc, "attention", 0, **limits)
    ffn = S._connector(sc, "ffn", 0, **limits)
    t = threading.Thread(target=att.start)
    t.start()
    ffn.start()
    t.join()
    hidden = torch.ones(1, sc.hidden)
    for step, mode in enumerate(slow):
        att.send_plan(StepPlan(step, mode, (1,)))
        assert ffn.recv_plan().step_id == step
        late = threading.Timer(0.8, lambda: att.send_a2f(0, 0, hidden))
        late.start()
        assert torch.equal(ffn.recv_a2f(0, 0).hidden, hidden)  # 0.8 s > timeout_s
        late.join()
        ffn.send_f2a(0, 0, hidden).wait()
        assert torch.equal(att.irecv_f2a(0, 0).wait(), hidden)
    att.send_plan(StepPlan(len(slow), fast, (1,)))
    assert ffn.recv_plan().step_id == len(slow)
    t0 = time.monotonic()
    with pytest.raises(AFDTimeoutError, match=r"timed out after 0.3s waiting"):
        ffn.recv_a2f(0, 0)
    assert time.monotonic() - t0 < 2.0
    att.close()
    ffn.close()


@pytest.mark.gpu
@pytest.mark.parametrize("gate", [False, True], ids=["ffn-gate", "attention-gate"])
@pytest.mark.parametrize("topo", [(1, 1), (2, 1)], ids=["1A1F", "2A1F"])
def test_p2p_nccl_round_trip_exact(topo, gate):
    a, f = topo
    if not torch.cuda.is_available() or torch.cuda.device_count() < a + f:
        pytest.skip(f"needs {a + f} CUDA GPUs (one per endpoint: NCCL)")
    sc = S.Scenario(
        "p2p", S.free_port(), a, f, num_ubatches=2, dtype="bfloat16",
        hidden=256, device="cuda", gate_on_attention=gate,
    )  # fmt: skip
    _ok(S.run(sc, limit_s=120))


@pytest.mark.parametrize("connector", CONNECTORS)
def test_call_after_failed_start_names_the_cause(connector):
    sc = S.Scenario(connector, S.free_port(), 1, 1, connect_timeout_s=0.3)
    att = S._connector(sc, "attention", 0)  # no FFN rank ever comes
    with pytest.raises(AFDConnectorError) as first:
        att.start()
    with pytest.raises(AFDConnectorError, match="failed earlier") as later:
        att.send_plan(StepPlan(0, ExecMode.EAGER, (1,)))
    assert str(first.value) in str(later.value)
    att.close()  # still idempotent
