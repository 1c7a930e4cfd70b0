"""The suite's fork servers (``forks.py``) start what ``python -m`` would.

A role process forked from a fork server must be the process the harness
would otherwise have started: its arguments, environment and working
directory, a session of its own, ``__main__`` named as with ``python -m`` (the
processes vLLM spawns import it by that name), its command line in ``ps``,
its exit code and a signal's as ``Popen`` reports them. Anything but
``vllm-afd serve`` is started as before.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import forks
import pytest

pytestmark = pytest.mark.e2e


def _seen(proc: forks.ForkedProcess) -> dict:
    return json.loads(proc.stdout.readline())


def test_a_forked_process_is_what_python_m_would_start() -> None:
    env = {**os.environ, "AFD_FORK_PROBE": "given"}
    proc = forks.SERVERS.fork([sys.executable, "-m", "fork_probe", "3", "a b"], env)
    seen = _seen(proc)
    assert seen.pop("ps").startswith(f"{sys.executable} -m fork_probe 3 a b")
    assert seen == {
        "argv": ["3", "a b"],
        "env": "given",
        "cwd": os.getcwd(),
        "session_leader": True,
        "main": "fork_probe",
    }
    assert proc.wait(30) == 3 and proc.poll() == 3
    assert proc.stdout.read() == b""  # the child's output ends with it


def test_a_forked_process_killed_reports_the_signal_as_popen_does() -> None:
    proc = forks.SERVERS.fork(
        [sys.executable, "-m", "fork_probe", "0", "--wait"], dict(os.environ)
    )
    assert _seen(proc)["session_leader"]
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # as the harness stops a role
    assert proc.wait(30) == -signal.SIGKILL


def test_only_vllm_afd_serve_is_forked() -> None:
    proc = forks.SERVERS.spawn([sys.executable, "-c", "print('exec')"], {})
    assert isinstance(proc, subprocess.Popen)
    assert proc.communicate(timeout=30)[0] == b"exec\n"


def test_a_fork_server_is_not_stopped_while_a_child_of_it_runs(monkeypatch):
    """Beyond ``KEEP`` fork servers an idle one is stopped, never one whose
    child still runs (the child's exit code comes from its fork server)."""
    monkeypatch.setattr(forks, "KEEP", 1)
    servers = forks.ForkServers()
    bare = {**os.environ, "FORK_SERVER_BARE": "1"}  # no vLLM: the probe needs none
    try:
        waiting = servers.fork(
            [sys.executable, "-m", "fork_probe", "0", "--wait"], bare
        )
        assert _seen(waiting)["session_leader"]
        other = {**bare, "FORK_PROBE_SERVER": "another"}  # another server
        done = servers.fork([sys.executable, "-m", "fork_probe", "5"], other)
        assert done.wait(60) == 5 and len(servers) == 2
        os.killpg(waiting.pid, signal.SIGKILL)
        assert waiting.wait(30) == -signal.SIGKILL
    finally:
        servers.close()
