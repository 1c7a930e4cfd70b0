"""p2p-only behaviour: ports in use, unreachable rendezvous."""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _scenarios as S  # noqa: E402

from vllm_afd.errors import AFDConnectorError, AFDTimeoutError  # noqa: E402


def test_port_in_use_names_address_and_fix():
    port = S.free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        ffn = S._connector(S.Scenario("p2p", port, 1, 1), "ffn", 0)
        with pytest.raises(AFDConnectorError) as e:
            ffn.start()
    msg = str(e.value)
    assert f"127.0.0.1:{port}" in msg and "already in use" in msg
    assert "afd.port" in msg


def test_unreadable_fingerprint_is_rejected_with_its_reason():
    """A HELLO from another vllm-afd version (same protocol version, a
    fingerprint field missing) is refused like a mismatch: the sender gets a
    REJECT that says why, and ffn rank 0 raises the same reason."""
    import threading

    from vllm_afd.connector import protocol
    from vllm_afd.errors import AFDProtocolError

    sc = S.Scenario("p2p", S.free_port(), 1, 1, connect_timeout_s=5.0)
    ffn = S._connector(sc, "ffn", 0)
    raised: list[BaseException] = []

    def run() -> None:
        try:
            ffn.start()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            raised.append(e)

    t = threading.Thread(target=run)
    t.start()
    hello = protocol.hello("attention", 0, S.fingerprint(sc, "attention", 0), None)
    del hello["fingerprint"]["top_k"]
    from vllm_afd.connector.p2p_wire import connect

    with connect("127.0.0.1", sc.port, time.monotonic() + 5, 5.0, "") as sock:
        sock.sendall(protocol.encode(hello))
        sock.settimeout(5)
        buf = bytearray()
        replies: list[dict] = []
        while not replies:
            chunk = sock.recv(65536)
            assert chunk, "ffn rank 0 closed without a reply"
            buf += chunk
            replies = protocol.decode_frames(buf)
    t.join(10)
    assert replies[0]["type"] == "REJECT"
    assert "unreadable fingerprint" in replies[0]["reason"]
    assert "top_k" in replies[0]["reason"]
    assert len(raised) == 1 and isinstance(raised[0], AFDProtocolError)
    assert str(raised[0]) == replies[0]["reason"]


def test_unreachable_ffn_fails_after_connect_timeout():
    sc = S.Scenario("p2p", S.free_port(), 1, 1, connect_timeout_s=0.5)
    att = S._connector(sc, "attention", 0)
    t0 = time.monotonic()
    with pytest.raises(AFDTimeoutError, match=f"could not reach 127.0.0.1:{sc.port}"):
        att.start()
    assert time.monotonic() - t0 < 3


@pytest.fixture
def rendezvous_log(monkeypatch):
    """INFO lines of the rendezvous, with progress lines every 0.1 s."""
    import logging

    from vllm_afd.connector import p2p_wire

    monkeypatch.setattr(p2p_wire, "PROGRESS_S", 0.1)
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler, log = Keep(logging.INFO), logging.getLogger("vllm_afd.connector")
    old = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield lines
    log.removeHandler(handler)
    log.setLevel(old)


def test_waiting_attention_logs_where_it_is_trying_to_connect(rendezvous_log):
    sc = S.Scenario("p2p", S.free_port(), 1, 1, connect_timeout_s=0.6)
    with pytest.raises(AFDTimeoutError):
        S._connector(sc, "attention", 0).start()
    waits = [m for m in rendezvous_log if "still trying to reach" in m]
    assert waits and f"127.0.0.1:{sc.port}" in waits[0], rendezvous_log
    assert "of connect_timeout_s=1" in waits[0]


def test_waiting_ffn_rank_0_logs_which_peers_are_missing(rendezvous_log):
    sc = S.Scenario("p2p", S.free_port(), 2, 1, connect_timeout_s=0.6)
    with pytest.raises(AFDTimeoutError, match="attention rank 0, attention rank 1"):
        S._connector(sc, "ffn", 0).start()
    waits = [m for m in rendezvous_log if "waiting for attention rank 0" in m]
    assert waits and f"listening on 127.0.0.1:{sc.port}" in waits[0], rendezvous_log


_FFN_PROGRAM = """
import sys, time
sys.path.insert(0, {here!r})
import _scenarios as S
ffn = S._connector(S.Scenario("p2p", {port}, 1, 1), "ffn", 0)
ffn.start()
print("up", flush=True)
time.sleep(60)
"""


def _watched_pair(kill: bool) -> tuple[list[str], float]:
    """An attention endpoint watching an FFN endpoint that leaves: SIGKILLed
    (another process) or closed (SHUTDOWN). Returns the messages and the
    seconds from the FFN leaving to the first message."""
    import subprocess
    import threading

    sc = S.Scenario("p2p", S.free_port(), 1, 1)
    lost: list[str] = []
    seen = threading.Event()
    ffn_proc = ffn = None
    if kill:
        here = os.path.dirname(os.path.abspath(__file__))
        program = _FFN_PROGRAM.format(here=here, port=sc.port)
        ffn_proc = subprocess.Popen(
            [sys.executable, "-c", program], stdout=subprocess.PIPE, text=True
        )
    else:
        ffn = S._connector(sc, "ffn", 0)
        threading.Thread(target=ffn.start, daemon=True).start()
    att = S._connector(sc, "attention", 0)
    att.start()
    att.watch_peers(lambda message: (lost.append(message), seen.set()))
    time.sleep(0.3)
    assert lost == []  # a live peer is not reported
    t0 = time.monotonic()
    if ffn_proc is not None:
        assert ffn_proc.stdout.readline().strip() == "up"
        ffn_proc.kill()
        ffn_proc.wait()
    else:
        ffn.close()
    assert seen.wait(5), "the watch never reported the FFN leaving"
    elapsed = time.monotonic() - t0
    time.sleep(0.3)
    att.close()
    return lost, elapsed


def test_watch_peers_reports_a_killed_ffn_at_once_naming_it():
    lost, elapsed = _watched_pair(kill=True)
    assert len(lost) == 1 and elapsed < 2
    assert lost[0].startswith("ffn rank 0 closed its connection"), lost


def test_watch_peers_reports_an_ffn_shutdown_once():
    lost, _ = _watched_pair(kill=False)
    assert len(lost) == 1
    assert lost[0].startswith("ffn rank 0 shut down"), lost


def test_watch_peers_is_silent_after_the_watcher_closes():
    sc = S.Scenario("p2p", S.free_port(), 1, 1)
    ffn = S._connector(sc, "ffn", 0)
    import threading

    threading.Thread(target=ffn.start, daemon=True).start()
    att = S._connector(sc, "attention", 0)
    att.start()
    lost: list[str] = []
    att.watch_peers(lost.append)
    att.close()
    ffn.close()
    time.sleep(1.5)
    assert lost == []
