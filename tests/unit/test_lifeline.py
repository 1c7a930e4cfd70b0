"""No process outlives what started it: real processes, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vllm_afd import lifeline

# A "server" that starts a child of its own, as vLLM starts its engine core;
# the child installs the lifeline and would sleep for a minute.
_SERVER = """
import os, subprocess, sys, time
env = dict(os.environ, AFD_SERVER_PID=str(os.getpid()))
child = subprocess.Popen([sys.executable, "-c", {child!r}], env=env)
print(child.pid, flush=True)
time.sleep(60)
"""
_CHILD = (
    "from vllm_afd import lifeline; lifeline.install(); {done}"
    "import time; time.sleep(60)"
)

# A "launcher" that starts a role in a session of its own; the role installs
# the lifeline and starts a helper in its group (its engine, say).
_LAUNCHER = """
import os, subprocess, sys, time
env = dict(os.environ, AFD_LAUNCHER_PID=str(os.getpid()))
role = subprocess.Popen([sys.executable, "-c", {role!r}], env=env,
                        start_new_session=True, stdout=subprocess.PIPE, text=True)
print(role.pid, role.stdout.readline().strip(), flush=True)
time.sleep(60)
"""
_ROLE = """
import os, subprocess, sys, time
env = {k: v for k, v in os.environ.items() if not k.startswith("AFD_")}
nap = "import time; time.sleep(60)"
helper = subprocess.Popen([sys.executable, "-c", nap], env=env)
from vllm_afd import lifeline
lifeline.install()
print(helper.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        state = stat.rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _gone_within(pids: list[int], seconds: float) -> float:
    t0 = time.monotonic()
    while any(_alive(p) for p in pids):
        assert time.monotonic() - t0 < seconds, [p for p in pids if _alive(p)]
        time.sleep(0.05)
    return time.monotonic() - t0


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("AFD_")}


@pytest.mark.parametrize("said_done", [False, True], ids=["working", "done"])
def test_a_child_of_an_afd_server_exits_when_the_server_is_killed(said_done):
    """After a grace (a normal shutdown finishes on its own), or at once when
    the child had told its peers it stops (``lifeline.done``)."""
    done = "lifeline.done(); " if said_done else ""
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER.format(child=_CHILD.format(done=done))],
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    child = int(server.stdout.readline())
    try:
        time.sleep(0.5)  # the child is up and watching
        assert _alive(child)
        server.kill()
        server.wait()
        took = _gone_within([child], lifeline.GRACE_S + 3)
        if said_done:
            assert took < lifeline.GRACE_S - 0.5, took
        else:
            assert took >= lifeline.GRACE_S - 0.5  # a normal stop had its grace
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_role_and_its_group_exit_when_the_launcher_is_killed():
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER.format(role=_ROLE)],
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    role, helper = (int(x) for x in launcher.stdout.readline().split())
    try:
        assert _alive(role) and _alive(helper)
        launcher.kill()
        launcher.wait()
        assert _gone_within([role, helper], 3) < 3
    finally:
        for pid in (role, helper):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_launcher_variable_counts_only_when_the_launcher_is_the_parent(
    monkeypatch,
):
    """A process that inherited AFD_LAUNCHER_PID from a grandparent (not the
    launcher's child) installs nothing."""
    monkeypatch.setattr(lifeline, "_watching", {})
    monkeypatch.delenv("AFD_SERVER_PID", raising=False)
    monkeypatch.setenv("AFD_LAUNCHER_PID", "1" if os.getppid() != 1 else "2")
    lifeline.install()
    assert lifeline._watching == {}


def test_wait_for_exit_without_pidfd_polls(monkeypatch):
    monkeypatch.delattr(os, "pidfd_open", raising=False)
    monkeypatch.setattr(lifeline, "POLL_S", 0.05)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    # reap it, as its parent would: kill(pid, 0) still finds a zombie
    threading.Thread(target=proc.wait, daemon=True).start()
    t0 = time.monotonic()
    lifeline.wait_for_exit(proc.pid)
    assert 0.2 < time.monotonic() - t0 < 5
