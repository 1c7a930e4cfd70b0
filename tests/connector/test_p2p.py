"""p2p-only behaviour: ports in use, unreachable rendezvous, what listens
where, who may join."""

from __future__ import annotations

import http.server
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _scenarios as S  # noqa: E402

from vllm_afd.connector import p2p_rendezvous, protocol  # noqa: E402
from vllm_afd.errors import (  # noqa: E402
    AFDConfigError,
    AFDConnectorError,
    AFDProtocolError,
    AFDTimeoutError,
)


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
        sock.settimeout(5)
        buf = bytearray()
        assert _frames(sock, buf)[0]["type"] == "WELCOME"
        sock.sendall(protocol.encode(hello))
        replies = _frames(sock, buf)
    t.join(10)
    assert replies[0]["type"] == "REJECT"
    assert "unreadable fingerprint" in replies[0]["reason"]
    assert "top_k" in replies[0]["reason"]
    assert len(raised) == 1 and isinstance(raised[0], AFDProtocolError)
    assert str(raised[0]) == replies[0]["reason"]


def _frames(sock, buf: bytearray) -> list[dict]:
    """The next complete frames from ``sock`` (at least one)."""
    out: list[dict] = []
    while not out:
        chunk = sock.recv(65536)
        assert chunk, "the listener closed without a reply"
        buf += chunk
        out = protocol.decode_frames(buf)
    return out


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


def _ffn_process(sc: S.Scenario, options: str):
    """An FFN endpoint (keyword ``options``) in a process of its own, started;
    it prints ``up`` once started."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    program = _FFN_PROGRAM.format(here=here, port=sc.port).replace(
        '"ffn", 0)', f'"ffn", 0, {options})'
    )
    return subprocess.Popen(
        [sys.executable, "-c", program], stdout=subprocess.PIPE, text=True
    )


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


def test_a_stopped_ffn_is_reported_after_timeout_s_without_heartbeat():
    """SIGSTOP keeps the FFN's sockets open (the kernel still acknowledges), so
    only the missing heartbeat tells: reported after timeout_s, not before,
    and not while the attention rank has planned no served step yet (start-up
    steps compile: the limit is warmup_timeout_s then)."""
    import signal

    from vllm_afd.connector.protocol import ExecMode, StepPlan

    sc = S.Scenario("p2p", S.free_port(), 1, 1)
    ffn = _ffn_process(sc, "timeout_s=1.5, heartbeat_interval_s=0.2")
    try:
        att = S._connector(sc, "attention", 0, timeout_s=1.5)
        att.start()
        assert ffn.stdout.readline().strip() == "up"
        lost: list[str] = []
        seen = threading.Event()
        att.watch_peers(lambda message: (lost.append(message), seen.set()))
        time.sleep(2.0)  # longer than timeout_s: heartbeats keep it quiet
        assert lost == []
        att.send_plan(StepPlan(1, ExecMode.WARMUP, (1,)))
        os.kill(ffn.pid, signal.SIGSTOP)
        time.sleep(2.5)  # warming up: warmup_timeout_s (600 s) applies
        assert lost == []
        os.kill(ffn.pid, signal.SIGCONT)
        time.sleep(0.5)
        att.send_plan(StepPlan(2, ExecMode.EAGER, (1,)))
        os.kill(ffn.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        assert seen.wait(10), "a stopped FFN was never reported"
        elapsed = time.monotonic() - t0
        assert 1.0 <= elapsed <= 1.5 + 1.5, elapsed
        assert lost[0].startswith("ffn rank 0 sent no heartbeat for"), lost
        assert "(timeout_s=1.5): it is hung, stopped or cut off" in lost[0]
        att.close()
    finally:
        ffn.kill()
        ffn.wait()


def test_a_wait_begun_late_in_a_heartbeat_silence_ends_with_the_silence():
    """With data parallelism an attention rank can begin a step's wait just
    before its hung FFN rank's heartbeat silence reaches ``timeout_s`` (its
    peer's step failed first and the ranks step together). The wait ends when
    the silence reaches its limit, not ``timeout_s`` after the wait began,
    and its error says why."""
    import signal

    from vllm_afd.connector.protocol import ExecMode, StepPlan
    from vllm_afd.errors import AFDPeerError

    timeout_s = 2.0
    sc = S.Scenario("p2p", S.free_port(), 1, 1)
    ffn = _ffn_process(sc, "heartbeat_interval_s=0.2")
    try:
        att = S._connector(sc, "attention", 0, timeout_s=timeout_s)
        att.start()
        assert ffn.stdout.readline().strip() == "up"
        att.watch_peers(lambda message: None)
        for step in (1, 2):  # the second is past the first served step
            att.send_plan(StepPlan(step, ExecMode.EAGER, (1,)))
        att.send_a2f(0, 0, torch.ones(1, sc.hidden))  # never received
        os.kill(ffn.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        time.sleep(0.6 * timeout_s)  # the wait begins late in the silence
        began = time.monotonic()
        with pytest.raises(AFDPeerError) as e:
            att.irecv_f2a(0, 0).wait()
        ended = time.monotonic()
        # the last heartbeat came before the stop: the silence ends by then
        assert ended - stopped <= timeout_s + 0.5, (ended - stopped, e.value)
        assert ended - began < timeout_s, (ended - began, e.value)
        message = str(e.value)
        assert message.startswith("ffn rank 0 sent no heartbeat for"), message
        assert "(timeout_s=2): it is hung, stopped or cut off" in message
        assert message.endswith("(step 2, layer 0, ubatch 0)"), message
        att.close()
    finally:
        ffn.kill()
        ffn.wait()


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


# ------------------------------------------------ what listens, who may join
def _listening(port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, _remote, state = line.split()[1:4]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.append(address)
    return found


class _Endpoint(threading.Thread):
    """Start one endpoint in a thread; ``error`` holds what it raised."""

    def __init__(self, sc: S.Scenario, role: str, rank: int, **options) -> None:
        super().__init__(daemon=True)
        self.conn = S._connector(sc, role, rank, **options)
        self.error: BaseException | None = None
        self.started = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            self.conn.start()
            self.started.set()
        except BaseException as e:  # noqa: BLE001 - read by the test thread
            self.error = e

    def wait_listening(self, port: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not _listening(port):
            assert time.monotonic() < deadline, f"nothing listens on {port}"
            assert self.error is None, self.error
            time.sleep(0.02)


def test_rendezvous_and_store_listen_on_afd_host_only():
    """ffn rank 0 binds afd.host:afd.port and the data-plane store at
    afd.port+1 to afd.host (127.0.0.1) alone, not every interface."""
    sc = S.Scenario("p2p", S.free_port(), 1, 1, connect_timeout_s=10.0)
    ffn = _Endpoint(sc, "ffn", 0)
    ffn.wait_listening(sc.port)
    assert _listening(sc.port) == ["0100007F"]
    assert _listening(sc.port + 1) == ["0100007F"]  # store, made before it
    att = _Endpoint(sc, "attention", 0)
    assert ffn.started.wait(20) and att.started.wait(20), (ffn.error, att.error)
    att.conn.close()
    ffn.conn.close()


@pytest.fixture
def warnings_log():
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler, log = Keep(logging.WARNING), logging.getLogger("vllm_afd.connector")
    log.addHandler(handler)
    yield lines
    log.removeHandler(handler)


class _Silent(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def _serve_in_thread(server) -> None:
    threading.Thread(target=server.serve_forever, daemon=True).start()


@pytest.mark.parametrize("peer", ["http server", "talker", "closer"])
def test_an_endpoint_fails_at_once_when_afd_port_is_not_vllm_afd(peer, monkeypatch):
    """afd.port held by another program: an HTTP server (says nothing until
    asked), one that talks first, one that hangs up. The endpoint fails
    within the greeting wait, naming the address and what it got."""
    monkeypatch.setattr(p2p_rendezvous, "GREETING_S", 1.0)
    port = S.free_port()
    if peer == "http server":
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Silent)
        _serve_in_thread(server)
        stop = server.shutdown
        expect = "sent no vllm-afd greeting within 1s"
    else:
        listener = socket.create_server(("127.0.0.1", port))

        def answer() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                if peer == "talker":
                    conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
                conn.close()

        threading.Thread(target=answer, daemon=True).start()
        stop = listener.close
        expect = {
            "talker": "does not speak the vllm-afd protocol (it sent b'SSH-2.0",
            "closer": "closed the connection without a vllm-afd greeting",
        }[peer]
    sc = S.Scenario("p2p", port, 1, 1, connect_timeout_s=30.0)
    t0 = time.monotonic()
    try:
        with pytest.raises(AFDProtocolError) as e:
            S._connector(sc, "attention", 0).start()
    finally:
        stop()
    assert time.monotonic() - t0 < 5  # not connect_timeout_s
    assert expect in str(e.value) and f"127.0.0.1:{port}" in str(e.value)
    assert "check afd.port" in str(e.value)


def test_ffn_rank_0_drops_a_peer_that_speaks_something_else(warnings_log):
    """An HTTP request to the rendezvous port is dropped with a warning; the
    rendezvous goes on and the real peer joins."""
    sc = S.Scenario("p2p", S.free_port(), 1, 1, connect_timeout_s=20.0)
    ffn = _Endpoint(sc, "ffn", 0)
    ffn.wait_listening(sc.port)
    with socket.create_connection(("127.0.0.1", sc.port), timeout=5) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk  # the WELCOME, then the hub hangs up
    assert protocol.decode_frames(bytearray(data))[0]["type"] == "WELCOME"
    att = _Endpoint(sc, "attention", 0)
    assert ffn.started.wait(20) and att.started.wait(20), (ffn.error, att.error)
    dropped = [m for m in warnings_log if "does not speak the vllm-afd" in m]
    assert dropped and "b'GET /health" in dropped[0], warnings_log
    att.conn.close()
    ffn.conn.close()


def _secret(tmp_path, name: str, value: str) -> str:
    path = tmp_path / name
    path.write_text(value + "\n")
    return str(path)


@pytest.mark.parametrize(
    ("hub", "intruder", "reason"),
    [
        ("a", None, "has no shared secret, but this listener requires one"),
        ("a", "b", "answered with another shared secret than this listener's"),
        (None, "a", "has a shared secret but this listener has none"),
    ],
)
def test_a_wrong_secret_refuses_that_endpoint_only(
    tmp_path, warnings_log, hub, intruder, reason
):
    """ffn rank 0 refuses an endpoint without the right secret (it fails at
    once, with the reason), logs it, and keeps waiting for the right one."""
    files = {k: _secret(tmp_path, k, f"secret-{k}") for k in ("a", "b")}
    opt = lambda k: {"secret_file": files[k]} if k else {}  # noqa: E731
    sc = S.Scenario("p2p", S.free_port(), 1, 1, connect_timeout_s=20.0)
    ffn = _Endpoint(sc, "ffn", 0, **opt(hub))
    t0 = time.monotonic()
    with pytest.raises(AFDProtocolError, match=reason):
        S._connector(sc, "attention", 0, **opt(intruder)).start()
    assert time.monotonic() - t0 < 5
    assert any(reason in m and "refused" in m for m in warnings_log), warnings_log
    att = _Endpoint(sc, "attention", 0, **opt(hub))
    assert ffn.started.wait(20) and att.started.wait(20), (ffn.error, att.error)
    att.conn.close()
    ffn.conn.close()


def test_a_shared_secret_admits_every_endpoint_of_2a2f(tmp_path, warnings_log):
    """Both legs authenticate: attention ranks reach ffn rank 1 through
    JOIN with the secret's answer to ffn rank 1's own nonce."""
    secret = {"secret_file": _secret(tmp_path, "s", "s3cret")}
    sc = S.Scenario("p2p", S.free_port(), 2, 2, connect_timeout_s=20.0)
    endpoints = [
        _Endpoint(sc, role, rank, **secret)
        for role, rank in (("ffn", 0), ("ffn", 1), ("attention", 0), ("attention", 1))
    ]
    for ep in endpoints:
        assert ep.started.wait(30), [e.error for e in endpoints]
    assert not [m for m in warnings_log if "refused" in m or "dropped" in m]
    for ep in endpoints[::-1]:
        ep.conn.close()


def test_secret_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("AFD_SECRET", "from-env")
    sc = S.Scenario("p2p", S.free_port(), 1, 1, connect_timeout_s=20.0)
    ffn = _Endpoint(sc, "ffn", 0)
    att = _Endpoint(sc, "attention", 0)
    assert ffn.started.wait(20) and att.started.wait(20), (ffn.error, att.error)
    att.conn.close()
    ffn.conn.close()
    both = {"secret_file": _secret(tmp_path, "f", "x")}
    with pytest.raises(AFDConfigError, match="set one of them"):
        S._connector(sc, "attention", 0, **both).start()


def test_rendezvous_off_loopback_without_secret_warns(warnings_log):
    from vllm_afd.connector.p2p_control import P2PControlPlane
    from vllm_afd.roles import AFDRole
    from vllm_afd.topology import Topology

    plane = P2PControlPlane(
        host="10.255.255.1", port=S.free_port(), topology=Topology(1, 1),
        role=AFDRole.ATTENTION, role_rank=0, timeout_s=1.0, connect_timeout_s=0.2,
    )  # fmt: skip
    with pytest.raises(AFDTimeoutError):
        plane.start(S.fingerprint(S.Scenario("p2p", 1, 1, 1), "attention", 0))
    assert any("not on loopback and has no shared secret" in m for m in warnings_log)


# --------------------------------------------- the session re-forms (M:N)
_2A2F = (("ffn", 0), ("ffn", 1), ("attention", 0), ("attention", 1))


def _session(sc: S.Scenario) -> dict:
    endpoints = {key: _Endpoint(sc, *key) for key in _2A2F}
    for ep in endpoints.values():
        assert ep.started.wait(30), [e.error for e in endpoints.values()]
    return {key: ep.conn for key, ep in endpoints.items()}


def _recv_plan_in_thread(conn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        out["plan"] = conn.recv_plan()
        out["why"] = conn.rejoining

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_an_attention_rank_that_rejoins_ends_the_session_for_everyone_2a2f():
    """Attention rank 1 lost its FFN rank and leaves to rejoin: both FFN
    ranks learn it (ffn 1 from its peer, ffn 0 from the membership), ffn 0's
    own attention peer learns it from ffn 0, and a new session forms on the
    same ports."""
    sc = S.Scenario("p2p", S.free_port(), 2, 2, connect_timeout_s=20.0)
    conns = _session(sc)
    waits = {k: _recv_plan_in_thread(conns[("ffn", k)]) for k in (0, 1)}
    lost: list[str] = []
    conns[("attention", 0)].watch_peers(lost.append)
    conns[("attention", 1)].close(protocol.REJOIN + "attention rank 1 lost ffn rank 1")
    for k, (thread, out) in waits.items():
        thread.join(10)
        assert not thread.is_alive(), f"ffn rank {k} never saw the session end"
        assert out["plan"] is None
        assert out["why"].startswith("attention rank 1 shut down (rejoin: "), out
    conns[("ffn", 0)].close(protocol.REJOIN + "ffn rank 0 re-forms")
    deadline = time.monotonic() + 10
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost and lost[0].startswith("ffn rank 0 shut down (rejoin: "), lost
    for conn in conns.values():
        conn.close()
    again = _session(sc)  # the ports are free again, everyone is back
    for conn in again.values():
        conn.close()


def test_a_member_that_dies_ends_the_session_on_ffn_rank_0_2a2f():
    """ffn rank 1 (another process) is SIGKILLed: ffn rank 0, which does not
    serve it, sees its membership connection drop; attention rank 1, whose
    FFN rank it was, sees it too."""
    import subprocess

    sc = S.Scenario("p2p", S.free_port(), 2, 2, connect_timeout_s=20.0)
    here = os.path.dirname(os.path.abspath(__file__))
    program = _FFN_PROGRAM.format(here=here, port=sc.port).replace(
        f'S.Scenario("p2p", {sc.port}, 1, 1), "ffn", 0',
        f'S.Scenario("p2p", {sc.port}, 2, 2, connect_timeout_s=20.0), "ffn", 1',
    )
    ffn1 = subprocess.Popen(
        [sys.executable, "-c", program], stdout=subprocess.PIPE, text=True
    )
    try:
        endpoints = {key: _Endpoint(sc, *key) for key in _2A2F if key != ("ffn", 1)}
        for ep in endpoints.values():
            assert ep.started.wait(30), [e.error for e in endpoints.values()]
        assert ffn1.stdout.readline().strip() == "up"
        thread, out = _recv_plan_in_thread(endpoints[("ffn", 0)].conn)
        lost: list[str] = []
        endpoints[("attention", 1)].conn.watch_peers(lost.append)
        ffn1.kill()
        ffn1.wait()
        thread.join(10)
        assert not thread.is_alive() and out["plan"] is None
        assert (
            out["why"] == "ffn rank 1 closed its connection (it exited or was killed)"
        )
        deadline = time.monotonic() + 10
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lost and lost[0].startswith("ffn rank 1 closed its connection"), lost
        for ep in endpoints.values():
            ep.conn.close()
    finally:
        ffn1.kill()
        ffn1.wait()


# ------------------------------------------ after a failed step (FFN side)
_ATTENTION_1_PROGRAM = """
import os, sys
sys.path.insert(0, {here!r})
import _scenarios as S
from vllm_afd.connector import protocol
from vllm_afd.connector.protocol import ExecMode, StepPlan
sc = S.Scenario("p2p", {port}, 2, 1, timeout_s=1.0, connect_timeout_s=20.0)
att = S._connector(sc, "attention", 1)
att.start()
att.send_plan(StepPlan(1, ExecMode.EAGER, (1,)))
print("up", flush=True)
what = sys.stdin.readline().strip()
if what == "rejoins":
    att.close(protocol.REJOIN + "attention rank 1 lost ffn rank 0")
elif what == "stops":
    att.close("attention rank 1 stops")
elif what == "dies":
    os._exit(9)  # the kernel closes its sockets: EOF, no SHUTDOWN
print("done", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("rank_1", ["rejoins", "stays", "stops", "dies", "stays alone"])
def test_after_a_failed_step_the_ffn_rank_rejoins_unless_a_peer_died(rank_1):
    """2A1F with both attention ranks inside a step (their plans received)
    when the FFN rank's step fails: attention rank 0 leaves to rendezvous
    again, as it does when it gave up on a stopped or cut-off FFN rank. The
    FFN rank re-forms the session unless attention rank 1 died (EOF without
    SHUTDOWN) or shut down for good; a rank still connected is waited for
    twice ``timeout_s`` (1 s here), then the session re-forms anyway, also
    when no rank left ("stays alone": rank 0 stays too). A death is kept in
    ``peer_gone``."""
    import subprocess

    from vllm_afd.connector.protocol import ExecMode, StepPlan

    sc = S.Scenario("p2p", S.free_port(), 2, 1, timeout_s=1.0, connect_timeout_s=20.0)
    ffn = _Endpoint(sc, "ffn", 0)
    att0 = _Endpoint(sc, "attention", 0)
    here = os.path.dirname(os.path.abspath(__file__))
    att1 = subprocess.Popen(
        [sys.executable, "-c", _ATTENTION_1_PROGRAM.format(here=here, port=sc.port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert att1.stdout.readline().strip() == "up"
        assert ffn.started.wait(30) and att0.started.wait(30), (ffn.error, att0.error)
        att0.conn.send_plan(StepPlan(1, ExecMode.EAGER, (1,)))
        assert ffn.conn.recv_plan() is not None  # the step both ranks are in
        if rank_1 != "stays alone":
            att0.conn.close(protocol.REJOIN + "attention rank 0 lost ffn rank 0")
        att1.stdin.write(rank_1 + "\n")
        att1.stdin.flush()
        if rank_1 == "dies":
            att1.wait(10)
        else:
            assert att1.stdout.readline().strip() == "done"
        t0 = time.monotonic()
        why = ffn.conn.rejoin_after_failure()
        took = time.monotonic() - t0
    finally:
        att1.kill()
        att1.wait()
        ffn.conn.close()
        att0.conn.close()
    rank_0_left = (
        "attention rank 0 shut down (rejoin: attention rank 0 lost ffn rank 0)"
    )
    if rank_1 in ("stops", "dies"):
        assert why is None and took < 1.0, (why, took)
        # a death is named (the FFN rank's launcher then stops its node with
        # an error); a stop is not
        assert ffn.conn.peer_gone == (
            "attention rank 1 closed its connection (it exited or was killed)"
            if rank_1 == "dies"
            else None
        )
    elif rank_1 == "rejoins":
        assert why == rank_0_left and took < 1.0, (why, took)
    elif rank_1 == "stays":
        assert why == rank_0_left and 2.0 <= took < 3.0, (why, took)
    else:
        assert 2.0 <= took < 3.0, took
        assert why == (
            "attention rank 0, attention rank 1 still connected 2s after the "
            "failed step"
        ), why
    assert ffn.conn.rejoining == why


def test_ffn_rank_0_hosts_the_data_plane_store_once_per_process():
    """A session re-formed after a failed step starts while the old one's
    group may still hold the old store (pending receives, the error's
    frames): FFN rank 0 hosts the store once per address and every session
    uses it, so the new session never meets its own port in use."""
    from vllm_afd.connector.p2p_data import P2PDataPlane

    port = S.free_port()

    def plane() -> P2PDataPlane:
        return P2PDataPlane(
            host="127.0.0.1", store_port=port + 1, global_rank=0, world_size=2,
            backend="gloo", timeout_s=1.0, connect_timeout_s=5.0,
        )  # fmt: skip

    old = plane()
    old.prepare()
    held = old._store  # what a failed session's group would keep alive
    old.close()
    new = plane()
    new.prepare()  # no "address already in use"
    assert new._store is held
    held.set("afd/next/k", b"v")  # the same store serves the next prefix
    new.close()


def test_a_shutdown_read_after_a_failed_heartbeat_is_still_a_shutdown():
    """An FFN rank stalled (SIGSTOP) past ``timeout_s`` between steps: its
    attention rank gives up, sends SHUTDOWN to rejoin and closes. Resumed, the
    FFN rank's heartbeat thread writes first and fails on the closed
    connection; the SHUTDOWN is still queued unread. The FFN rank must read it
    and re-form the session, not take the peer for dead (which stops it)."""
    sc = S.Scenario("p2p", S.free_port(), 1, 1, connect_timeout_s=20.0)
    ffn = _Endpoint(sc, "ffn", 0, heartbeat_interval_s=0.05)
    att = _Endpoint(sc, "attention", 0)
    for ep in (ffn, att):
        assert ep.started.wait(30), (ffn.error, att.error)
    channel = ffn.conn._control._channels[0]
    try:
        att.conn.close(protocol.REJOIN + "attention rank 0 lost ffn rank 0")
        deadline = time.monotonic() + 10
        while not channel.broken:  # a heartbeat met the closed connection
            assert time.monotonic() < deadline, "no heartbeat send failed"
            time.sleep(0.01)
        assert ffn.conn.recv_plan() is None
        assert ffn.conn.rejoining == (
            "attention rank 0 shut down (rejoin: attention rank 0 lost ffn rank 0)"
        )
    finally:
        ffn.conn.close()


@pytest.mark.parametrize("reason", ["closed", protocol.REJOIN + "lost ffn rank 0"])
def test_an_attention_rank_that_stops_mid_step_ends_the_ffn_step_as_a_stop(reason):
    """1A1F inside a step: the attention rank sends its plan and shuts down
    before its A2F (its deployment was stopped while it served). A SHUTDOWN
    for good ends the FFN rank's wait with :class:`AFDPeerStopped` (its loop
    then stops as between steps); one that rejoins, with a plain
    :class:`AFDPeerError` (a failed step)."""
    from vllm_afd.connector.protocol import ExecMode, StepPlan
    from vllm_afd.errors import AFDPeerError, AFDPeerStopped

    sc = S.Scenario("p2p", S.free_port(), 1, 1, connect_timeout_s=20.0)
    ffn, att = _Endpoint(sc, "ffn", 0), _Endpoint(sc, "attention", 0)
    for ep in (ffn, att):
        assert ep.started.wait(30), (ffn.error, att.error)
    try:
        att.conn.send_plan(StepPlan(1, ExecMode.EAGER, (1,)))
        assert ffn.conn.recv_plan() is not None
        att.conn.close(reason)
        with pytest.raises(AFDPeerError, match="attention rank 0 shut down") as e:
            ffn.conn.recv_a2f(0, 0)
    finally:
        ffn.conn.close()
        att.conn.close()
    assert isinstance(e.value, AFDPeerStopped) == (reason == "closed"), e.value


def test_a_peer_lagging_behind_a_dummy_step_is_waited_timeout_s_once_served(
    monkeypatch,
):
    """2A1F: before this FFN process served a step, a WARMUP plan is a
    start-up forward (it may compile), and a peer's plan lagging behind it
    is waited ``warmup_timeout_s``; once it served one (in any session), a
    WARMUP plan is an idle data-parallel rank's dummy forward and the lag
    limit is ``timeout_s``: a peer that never sends (it is stuck elsewhere)
    fails the step in seconds instead of holding every rank for minutes."""
    from vllm_afd.connector import p2p_control
    from vllm_afd.connector.protocol import ExecMode, StepPlan

    monkeypatch.setattr(p2p_control, "_served_in_process", False)
    sc = S.Scenario("p2p", S.free_port(), 2, 1, connect_timeout_s=20.0)
    limits = {"timeout_s": 0.5, "warmup_timeout_s": 60.0}
    ffn = _Endpoint(sc, "ffn", 0, **limits)
    att = [_Endpoint(sc, "attention", r, **limits) for r in (0, 1)]
    for ep in (ffn, *att):
        assert ep.started.wait(30), [e.error for e in (ffn, *att)]
    try:
        att[0].conn.send_plan(StepPlan(0, ExecMode.WARMUP, (0,)))
        late = threading.Timer(
            1.0, att[1].conn.send_plan, (StepPlan(0, ExecMode.WARMUP, (0,)),)
        )
        late.start()  # 1.0 s > timeout_s: tolerated until a step is served
        assert ffn.conn.recv_plan().step_id == 0
        late.join()
        assert not p2p_control._served_in_process
        for ep in att:
            ep.conn.send_plan(StepPlan(1, ExecMode.EAGER, (0,)))
        assert ffn.conn.recv_plan().step_id == 1
        assert p2p_control._served_in_process
        att[0].conn.send_plan(StepPlan(2, ExecMode.WARMUP, (0,)))
        t0 = time.monotonic()
        with pytest.raises(AFDTimeoutError) as e:
            ffn.conn.recv_plan()
        assert time.monotonic() - t0 < 5.0, str(e.value)
        assert str(e.value) == (
            "timed out after 0.5s waiting for the plan of step 2 from attention rank 1"
        )
    finally:
        for ep in (ffn, *att):
            ep.conn.close()


def test_an_ffn_rank_names_the_attention_rank_whose_plan_lags(monkeypatch, caplog):
    """2A1F: attention rank 0's plan arrives, rank 1's a second later. Past
    ``PLAN_LAG_WARN_S`` the FFN rank logs, once, who sent the step's plan and
    whose it still waits for (the sender already waits for this rank's
    reply), then serves the step when the plan comes."""
    import logging

    from vllm_afd.connector import p2p_control
    from vllm_afd.connector.protocol import ExecMode, StepPlan

    monkeypatch.setattr(p2p_control, "PLAN_LAG_WARN_S", 0.3)
    sc = S.Scenario("p2p", S.free_port(), 2, 1, connect_timeout_s=20.0)
    limits = {"timeout_s": 30.0}
    ffn = _Endpoint(sc, "ffn", 0, **limits)
    att = [_Endpoint(sc, "attention", r, **limits) for r in (0, 1)]
    for ep in (ffn, *att):
        assert ep.started.wait(30), [e.error for e in (ffn, *att)]
    try:
        att[0].conn.send_plan(StepPlan(7, ExecMode.EAGER, (3,)))
        late = threading.Timer(
            1.0, att[1].conn.send_plan, (StepPlan(7, ExecMode.EAGER, (2,)),)
        )
        late.start()
        with caplog.at_level(logging.WARNING, logger=p2p_control.__name__):
            assert ffn.conn.recv_plan().step_id == 7
        late.join()
        lags = [
            r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()
        ]
        assert len(lags) == 1, lags
        assert lags[0].startswith(
            "AFD ffn rank 0: attention rank 0 sent the plan of step 7 (EAGER) "
        ), lags[0]
        assert (
            "still waiting for the plan from attention rank 1 "
            "(a lagging rank is waited 30s)" in lags[0]
        )
    finally:
        for ep in (ffn, *att):
            ep.conn.close()


def test_an_ffn_rank_closed_after_a_failed_step_ends_every_wait_on_it_at_once():
    """2A1F in a start-up step (waits of ``warmup_timeout_s``, 60 s): attention
    rank 0 sent its A2F and waits for the F2A; attention rank 1 leaves to
    rendezvous again, so the FFN rank's wait for the step's A2F fails. The
    FFN rank keeps its error (as its loop does) and closes: attention rank
    0's wait ends at once. Gloo closes a group's connections only when the
    group is freed, and the error's frames held the group's transfers: close
    releases them."""
    from vllm_afd.connector.protocol import ExecMode, StepPlan
    from vllm_afd.errors import AFDError, AFDPeerError

    sc = S.Scenario("p2p", S.free_port(), 2, 1, connect_timeout_s=20.0)
    slow = {"warmup_timeout_s": 60.0}
    ffn = _Endpoint(sc, "ffn", 0, **slow)
    att = [_Endpoint(sc, "attention", r, **slow) for r in (0, 1)]
    for ep in (ffn, *att):
        assert ep.started.wait(30), [e.error for e in (ffn, *att)]
    for ep in att:
        ep.conn.send_plan(StepPlan(1, ExecMode.WARMUP, (1,)))
    assert ffn.conn.recv_plan() is not None
    out: dict = {}

    def step_of_rank_0() -> None:
        conn = att[0].conn
        conn.send_a2f(0, 0, torch.ones(1, sc.hidden))
        try:
            conn.irecv_f2a(0, 0).wait()
        except AFDError as e:
            out["error"], out["at"] = e, time.monotonic()

    rank_0 = threading.Thread(target=step_of_rank_0, daemon=True)
    rank_0.start()
    att[1].conn.close(protocol.REJOIN + "attention rank 1 lost ffn rank 0")
    with pytest.raises(AFDPeerError, match="attention rank 1 shut down") as failed:
        ffn.conn.recv_a2f(0, 0)
    kept = failed.value  # noqa: F841 - as the FFN loop keeps it
    closed = time.monotonic()
    ffn.conn.close(protocol.REJOIN + "ffn rank 0 re-forms")
    rank_0.join(15)
    try:
        assert not rank_0.is_alive(), "attention rank 0's wait outlived the FFN rank"
        assert out["at"] - closed < 3.0, out
        assert str(out["error"]).startswith("ffn rank 0 shut down (rejoin: "), out
    finally:
        att[0].conn.close()


# --------------------------------------------- a cut link (network namespaces)
_NS_PROGRAM = """
import sys, time
sys.path.insert(0, {here!r})
import _scenarios as S
from vllm_afd.config import parse_afd_config
from vllm_afd.connector import create_connector
from vllm_afd.connector.protocol import ExecMode, StepPlan
role = {role!r}
sc = S.Scenario("p2p", {port}, 1, 1)
cfg = parse_afd_config({{
    "role": role, "host": {host!r}, "port": {port},
    "connector_extra_config": {{
        "timeout_s": 2.0, "heartbeat_interval_s": 0.2, "connect_timeout_s": 30,
    }},
}})
conn = create_connector(cfg, 0, S.fingerprint(sc, role, 0), "cpu")
conn.start()
if role == "attention":
    conn.send_plan(StepPlan(1, ExecMode.EAGER, (1,)))
    conn.watch_peers(lambda message: print("lost", message, flush=True))
print("up", flush=True)
time.sleep(60)
"""


def test_a_cut_link_is_reported_after_timeout_s_without_heartbeat():
    """The FFN and attention endpoints on two emulated hosts; the FFN host's
    link goes down (no FIN, no RST: TCP stays open): only the heartbeat
    silence tells, within timeout_s."""
    import subprocess

    sys.path.insert(0, str(Path(__file__).parents[1] / "e2e"))
    import hosts as H

    why = H.unavailable()
    if why is not None:
        pytest.skip(why)
    here = os.path.dirname(os.path.abspath(__file__))
    port = S.free_port()
    procs: list[subprocess.Popen] = []
    with H.emulated_hosts(2) as (hosts, _):
        ffn_host, att_host = hosts
        try:
            for role, host in (("ffn", ffn_host), ("attention", att_host)):
                program = _NS_PROGRAM.format(
                    here=here, role=role, port=port, host=ffn_host.address
                )
                procs.append(
                    subprocess.Popen(
                        host.argv([sys.executable, "-c", program]),
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
            for proc in procs:
                assert proc.stdout.readline().strip() == "up"
            subprocess.run(
                ["ip", "-n", ffn_host.name, "link", "set", ffn_host.interface, "down"],
                check=True,
            )
            cut = time.monotonic()
            line = procs[1].stdout.readline().strip()
            elapsed = time.monotonic() - cut
            assert line.startswith("lost ffn rank 0 sent no heartbeat for"), line
            assert "(timeout_s=2): it is hung, stopped or cut off" in line
            assert 1.5 <= elapsed <= 2.0 + 1.5, elapsed
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()


def test_ffn_rank_k_stops_for_good_when_the_session_host_does():
    """2A2F: FFN rank 0 stops for good (its attention peer shut down: the
    deployment is stopping). FFN rank 1, whose own attention peer may sit on
    a headless node nothing else tells, ends its wait for plans once that
    peer sent none for ``timeout_s``, as after a SHUTDOWN of its peers (not
    to rendezvous again), so its server stops and its launcher stops that
    node. (Peers still finishing a step send their plans within ``timeout_s``:
    the contract suite's 4A2F runs, where FFN rank 0 finishes first.)"""
    sc = S.Scenario("p2p", S.free_port(), 2, 2, connect_timeout_s=20.0, timeout_s=2.0)
    endpoints = {
        (role, rank): _Endpoint(sc, role, rank)
        for role, rank in (("ffn", 0), ("ffn", 1), ("attention", 0), ("attention", 1))
    }
    for ep in endpoints.values():
        assert ep.started.wait(30), [e.error for e in endpoints.values()]
    ffn1 = endpoints[("ffn", 1)].conn
    got: dict = {}

    def wait_for_plan() -> None:
        got["plan"] = ffn1.recv_plan()
        got["at"] = time.monotonic()

    waiter = threading.Thread(target=wait_for_plan, daemon=True)
    waiter.start()
    stopped = time.monotonic()
    endpoints[("ffn", 0)].conn.close("ffn rank 0 stops: attention peers shut down")
    waiter.join(10)
    try:
        assert not waiter.is_alive(), "ffn rank 1 kept waiting for plans"
        assert got["plan"] is None and ffn1.rejoining is None
        assert sc.timeout_s <= got["at"] - stopped < sc.timeout_s + 3.0
    finally:
        for key in (("attention", 0), ("attention", 1), ("ffn", 1)):
            endpoints[key].conn.close()


@pytest.mark.parametrize(
    "mode,device,capturable,refused",
    [
        ("CAPTURE", "cuda", False, True),  # Gloo moves in a CUDA graph: refused
        ("CAPTURE", "cuda", True, False),  # nccl, cuda_ipc
        ("CAPTURE", "cpu", False, False),  # never captured for real
        ("EAGER", "cuda", False, False),
        ("REPLAY", "cuda", True, False),
    ],
)
def test_a_data_plane_that_cannot_be_captured_refuses_a_capture_step(
    mode, device, capturable, refused
):
    """An attention rank asked to capture a step over a plane whose moves a
    CUDA graph cannot record fails at once, naming the plane and the fix,
    instead of capturing host-side transfers that would never replay."""
    from vllm_afd.connector.connector import capture_refusal
    from vllm_afd.connector.data import Capabilities
    from vllm_afd.connector.protocol import ExecMode

    caps = Capabilities(
        graph_capturable=capturable, matches_tags=True, bounded_wait=True
    )
    why = capture_refusal(ExecMode[mode], device, caps, "gloo")
    assert (why is not None) is refused
    if refused:
        assert why.startswith("the gloo data plane cannot be captured in a CUDA")
        assert "--enforce-eager" in why
