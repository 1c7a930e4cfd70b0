"""The Prometheus multiprocess directory of an AFD server, and its cleanup.

An AFD server's workers write their counters to files in
``PROMETHEUS_MULTIPROC_DIR``, which the server makes at start-up unless the
user set it (``engine_config._enable_worker_metrics``). The directory is removed when
the server exits normally; a server killed by SIGKILL (the OOM killer, a
supervisor's last resort) cannot remove it, so each new server removes the
directories of dead ones first: a directory's name holds its server's pid
namespace and pid, and one whose server is gone is removed. A directory of
another pid namespace (a container sharing ``/tmp``) is never touched: its
pid means nothing here.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

from vllm_afd.lifeline import alive

PREFIX = "vllm-afd-metrics-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-(\d+)-")


def _pid_namespace() -> str:
    """This process's pid namespace id (``/proc/self/ns/pid``), or ``0``."""
    try:
        return os.readlink("/proc/self/ns/pid").removeprefix("pid:[").rstrip("]")
    except OSError:
        return "0"


def remove_stale(root: Path | None = None) -> list[Path]:
    """Remove the metrics directories under ``root`` (the temp directory) of
    servers of this pid namespace that are gone; the paths removed."""
    root = Path(tempfile.gettempdir()) if root is None else root
    namespace, removed = _pid_namespace(), []
    with contextlib.suppress(OSError):
        for path in root.glob(f"{PREFIX}*"):
            match = _NAME.match(path.name)
            if match is None or match[1] != namespace or alive(int(match[2])):
                continue
            if path.is_dir() and path.stat().st_uid == os.getuid():
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def make() -> str:
    """A new metrics directory of this server, removed at its exit, after
    the directories of dead servers are removed."""
    remove_stale()
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{_pid_namespace()}-{os.getpid()}-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
