"""A role ends with its launcher, even when the launcher is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROLE = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from vllm_afd.cli.launcher_watch import watch_launcher
    assert watch_launcher(int(os.environ["AFD_LAUNCHER_PID"])) is not None
    # an "engine" child in the role's process group
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[1], "w").write(f"{os.getpid()} {child.pid}")
    time.sleep(600)
    """
)

LAUNCHER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    env = dict(os.environ, AFD_LAUNCHER_PID=str(os.getpid()))
    subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env=env,
                     start_new_session=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purpose
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def _wait(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_role_and_its_children_die_within_seconds_of_launcher_sigkill(tmp_path):
    pids = tmp_path / "pids"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, ROLE, str(pids)], start_new_session=True
    )
    try:
        assert _wait(lambda: pids.exists() and pids.read_text().strip(), 30)
        role, engine = map(int, pids.read_text().split())
        assert _alive(role) and _alive(engine)
        launcher.kill()
        launcher.wait(10)
        assert _wait(lambda: not _alive(role) and not _alive(engine), 5.0)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in map(int, (pids.read_text().split() if pids.exists() else [])):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_watch_is_not_started_under_a_process_that_is_not_the_parent():
    from vllm_afd.cli.launcher_watch import watch_launcher

    assert watch_launcher(os.getpid()) is None  # we are not our own parent
