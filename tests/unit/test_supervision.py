"""``Deployment.supervise``: what the launcher does when a role dies or hangs.

The role processes are real: a small HTTP server answering ``/health`` stands
in for each ``vllm serve`` (supervision only sees processes and ``/health``).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time

import pytest

from vllm_afd.deploy import (
    Deployment,
    DeploymentEnded,
    DeploymentSpec,
    LaunchError,
    RoleProcess,
)
from vllm_afd.deploy import deployment as launch
from vllm_afd.deploy.deployment import MAX_BACKOFF_S

SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: an FFN stand-in that does what the FFN role does when its attention peers
#: shut down for good (SIGUSR1): say so (AFD_STOP_NOTE), stop (exit 0); or
#: when one of them died (SIGUSR2): say which, stop (exit 1)
ENDING = (
    "import os, signal\n"
    "from vllm_afd import envs\n"
    "def end(*_):\n"
    "    envs.note_stop('attention peers shut down')\n"
    "    os._exit(0)\n"
    "def died(*_):\n"
    "    envs.note_stop('attention rank 0 closed its connection', peer_died=True)\n"
    "    os._exit(1)\n"
    "signal.signal(signal.SIGUSR1, end)\n"
    "signal.signal(signal.SIGUSR2, died)\n" + SERVER
)


def _role(name: str, program: str = SERVER) -> RoleProcess:
    port = _free_port()
    argv = [sys.executable, "-c", program, str(port)]
    return RoleProcess(name, argv, port, dict(os.environ))


def _deployment(ffn_program: str = SERVER, **spec_kw) -> Deployment:
    deployment = Deployment(DeploymentSpec(model="m", **spec_kw), log=None)
    deployment.processes = [_role("ffn", ffn_program), _role("attention")]
    for proc in deployment.processes:
        proc.start(None)
    deadline = time.monotonic() + 30
    while not all(p.healthy() for p in deployment.processes):
        assert time.monotonic() < deadline, "the stand-in servers never answered"
        time.sleep(0.05)
    deployment.ready = True
    return deployment


def _supervise_until(deployment: Deployment, cond, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "supervision never got there"
        deployment.supervise()
        time.sleep(0.05)


def test_a_dead_ffn_rank_is_restarted_with_backoff(capsys):
    deployment = _deployment(ffn_restarts=3)
    ffn = deployment.processes[0]
    try:
        first = ffn.proc.pid
        os.killpg(first, signal.SIGKILL)
        ffn.proc.wait()
        deployment.supervise()
        assert ffn.restart_at is not None and ffn.restarts == 1
        assert "ffn exited with code -9; restarting it in 1s" in capsys.readouterr().err
        _supervise_until(deployment, lambda: ffn.exit_code() is None, 5)
        assert ffn.proc.pid != first
        _supervise_until(deployment, ffn.healthy, 30)
        assert "starting ffn again (restart 1)" in capsys.readouterr().err
        # A second death in a row waits twice as long.
        os.killpg(ffn.proc.pid, signal.SIGKILL)
        ffn.proc.wait()
        now = time.monotonic()
        deployment.supervise(now)
        assert ffn.restarts == 2 and ffn.restart_at == pytest.approx(now + 2.0)
        assert MAX_BACKOFF_S == 30.0
    finally:
        deployment.stop(5)


def test_restarts_used_up_or_off_stop_the_deployment():
    for restarts, why in ((0, "restarts are off"), (1, "failed 1 restarts in a row")):
        deployment = _deployment(ffn_restarts=restarts)
        ffn = deployment.processes[0]
        try:
            for _ in range(restarts):
                os.killpg(ffn.proc.pid, signal.SIGKILL)
                ffn.proc.wait()
                _supervise_until(deployment, lambda f=ffn: f.exit_code() is None, 5)
            os.killpg(ffn.proc.pid, signal.SIGKILL)
            ffn.proc.wait()
            with pytest.raises(LaunchError, match=why):
                deployment.supervise()
            assert all(p.exit_code() is not None for p in deployment.processes)
        finally:
            deployment.stop(5)


def test_a_hung_ffn_rank_is_killed_and_restarted(capsys):
    deployment = _deployment(ffn_restarts=2, ffn_health_timeout_s=1.0)
    ffn = deployment.processes[0]
    try:
        deployment.supervise()  # healthy: nothing to do
        stopped = ffn.proc.pid
        os.killpg(stopped, signal.SIGSTOP)
        _supervise_until(deployment, lambda: ffn.restart_at is not None, 10)
        err = capsys.readouterr().err
        assert re.search(
            r"ffn has not answered /health for \d+s \(hung\); killing", err
        )
        assert ffn.proc.returncode == -signal.SIGKILL
        _supervise_until(deployment, ffn.healthy, 30)
        assert ffn.proc.pid != stopped
    finally:
        deployment.stop(5)


@pytest.mark.parametrize("ffn_says", [False, True], ids=["ffn silent", "peer died"])
def test_a_dead_attention_process_stops_every_role(monkeypatch, ffn_says):
    """The node's attention process died: every role stops, and the error
    names that process, also when the FFN rank said first that its peer
    died."""
    monkeypatch.setattr(launch, "STOP_NOTE_GRACE_S", 0.5)
    deployment = _deployment(ffn_program=ENDING)
    try:
        ffn, attention = deployment.processes
        os.killpg(attention.proc.pid, signal.SIGKILL)
        attention.proc.wait()
        if ffn_says:
            os.kill(ffn.proc.pid, signal.SIGUSR2)
            ffn.proc.wait(10)
        with pytest.raises(LaunchError, match="an attention rank cannot rejoin") as e:
            deployment.supervise()
        assert str(e.value).startswith("the attention process exited with code -9")
        assert deployment.processes[0].exit_code() is not None
    finally:
        deployment.stop(5)


@pytest.mark.parametrize(
    ("sig", "code", "error", "message"),
    [
        (
            signal.SIGUSR1,
            0,
            DeploymentEnded,
            "ffn stopped by itself (attention peers shut down: the deployment "
            "was stopped); every role of this node stops",
        ),
        (
            signal.SIGUSR2,
            1,
            LaunchError,
            "ffn stopped by itself: attention rank 0 closed its connection; an "
            "attention rank cannot rejoin a running deployment, so every role "
            "of this node stops",
        ),
    ],
    ids=["stopped", "peer died"],
)
def test_an_ffn_rank_that_stopped_by_itself_stops_the_node_unrestarted(
    capsys, sig, code, error, message
):
    """An FFN rank whose attention peers shut down for good (the deployment
    was stopped, e.g. from its API server's node) is not restarted: the
    launcher stops every role of its node and ends without an error
    (:class:`DeploymentEnded`). One whose attention peer died (on another
    node: this node's attention process still runs) is not restarted either:
    no attention rank can rejoin, so the node stops with an error."""
    deployment = _deployment(ffn_program=ENDING)
    ffn = deployment.processes[0]
    note = ffn.stop_note
    try:
        deployment.supervise()  # running: nothing to do
        os.kill(ffn.proc.pid, sig)
        assert ffn.proc.wait(10) == code
        with pytest.raises(error) as ended:
            deployment.supervise()
        assert type(ended.value) is error
        assert str(ended.value) == message
        assert all(p.exit_code() is not None for p in deployment.processes)
        assert "restarting" not in capsys.readouterr().err
        assert note is not None and not os.path.exists(note)
    finally:
        deployment.stop(5)


def test_an_attention_exit_just_before_the_ffn_says_stopped_is_no_failure():
    """Across hosts, a headless attention rank may exit (its data-parallel
    peer on the API node went away) a moment before the FFN rank of its node
    says the deployment was stopped: the launcher waits for that word
    (``STOP_NOTE_GRACE_S``) and ends without an error."""
    deployment = _deployment(ffn_program=ENDING)
    ffn, attention = deployment.processes
    try:
        os.killpg(attention.proc.pid, signal.SIGKILL)
        attention.proc.wait()
        timer = threading.Timer(1.0, os.kill, (ffn.proc.pid, signal.SIGUSR1))
        timer.start()
        with pytest.raises(DeploymentEnded, match="ffn stopped by itself"):
            deployment.supervise()
        timer.join()
    finally:
        deployment.stop(5)
