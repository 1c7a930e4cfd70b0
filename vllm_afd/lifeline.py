"""No process of a role outlives what started it.

Two links, each a daemon thread that waits on a process-exit file
descriptor (``pidfd``; a 0.5 s poll where the kernel has none):

* the role's API server, started by ``vllm-afd launch``, watches the
  launcher (``AFD_LAUNCHER_PID``): when the launcher is gone, SIGKILL
  included, the server kills its process group (the launcher gives every
  role a session of its own) and itself;
* every other process of an AFD server (vLLM's engine core and workers)
  watches the server (``AFD_SERVER_PID``): when the server is gone (killed,
  crashed, or stopped while its engine was still starting, e.g. waiting in
  the connector's rendezvous) the process exits after :data:`GRACE_S`, which
  leaves a normal shutdown time to finish on its own; at once when the
  process has said all it must to its peers (:func:`done`: an AFD worker
  whose connector is closed, left with the interpreter's teardown).

Imports neither vLLM nor torch.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time

from vllm_afd import envs

#: seconds a process whose server is gone may take to exit on its own
GRACE_S = 2.0
#: poll interval where ``os.pidfd_open`` is not available
POLL_S = 0.5

_watching: dict[int, int] = {}  # this process's pid -> the pid it watches
_done = threading.Event()


def done() -> None:
    """This process has told its peers it stops: once its server is gone it
    need not take :data:`GRACE_S` to exit."""
    _done.set()


def install() -> None:
    """Start this process's link, if it has one (idempotent per process;
    vLLM calls the plugin's ``register`` in every process it starts)."""
    me = os.getpid()
    if me in _watching:
        return
    server = envs.server_pid()
    launcher = envs.launcher_pid()
    if server is not None and server != me:
        _watching[me] = server
        _start(server, f"its server process (pid {server})", GRACE_S, group=False)
    elif launcher is not None and os.getppid() == launcher:
        # the variable is only ours when the launcher is our parent
        _watching[me] = launcher
        _start(launcher, f"its launcher (pid {launcher})", 0.0, group=True)


def _start(pid: int, what: str, grace_s: float, *, group: bool) -> None:
    threading.Thread(
        target=_watch,
        args=(pid, what, grace_s, group),
        name="afd-lifeline",
        daemon=True,
    ).start()


def wait_for_exit(pid: int) -> None:
    """Block until process ``pid`` has exited (returns at once if it has)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd: poll
        while alive(pid):
            time.sleep(POLL_S)
        return
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)


def alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch(pid: int, what: str, grace_s: float, group: bool) -> None:
    wait_for_exit(pid)
    if _done.is_set():
        grace_s = 0.0
    # stderr may be a pipe to the process that is gone: never let a write
    # error keep this process alive
    with contextlib.suppress(Exception):
        sys.stderr.write(
            f"vllm-afd: {what} is gone; process {os.getpid()} exits"
            + (f" in {grace_s:.0f}s unless it stops first\n" if grace_s else "\n")
        )
        sys.stderr.flush()
    if grace_s:
        _done.wait(grace_s)
    if group and os.getpgrp() == os.getpid():
        with contextlib.suppress(OSError):
            os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
