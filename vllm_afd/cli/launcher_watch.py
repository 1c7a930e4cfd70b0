"""A role started by ``vllm-afd launch`` ends when its launcher is gone.

The launcher starts each role in a session (process group) of its own and
passes its pid in ``AFD_LAUNCHER_PID``. A daemon thread in the role's API
server process checks its parent every :data:`INTERVAL_S`: once the launcher
is no longer the parent (it died, by SIGKILL too, and the role was
re-parented), the thread kills the role's whole process group, so the API
server, engine core and worker processes stop and free their ports.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

INTERVAL_S = 0.5


def watch_launcher(launcher_pid: int) -> threading.Thread | None:
    """Start the watch over ``launcher_pid``; None (no watch) when it is not
    this process's parent to begin with (the variable was inherited by a
    process the launcher did not start)."""
    if os.getppid() != launcher_pid:
        return None

    def watch() -> None:
        while os.getppid() == launcher_pid:
            time.sleep(INTERVAL_S)
        sys.stderr.write(
            f"vllm-afd: launcher (pid {launcher_pid}) is gone; stopping this "
            "role and its engine processes\n"
        )
        sys.stderr.flush()
        if os.getpgrp() == os.getpid():  # our own session: the role's group
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="afd-launcher-watch", daemon=True)
    thread.start()
    return thread
