"""Whether each attention rank of this server has its FFN rank, for its API.

An attention rank's engine runs in another process than the API server that
answers for it, so each rank's FFN link (``worker.ffn_link``) writes its state
to a small JSON file in a directory named after the server's pid
(``AFD_SERVER_PID``), replaced atomically on every change. Every API server
process (one per local rank with data parallelism) looks at the directory's
modification time on each request and reads the files again when it moved,
so no process answers from a state older than the last change: a ``200`` from
one is never followed by a ``503`` from another for a change made before it.
A rank without a file has not opened its link yet and counts as up: vLLM does
not answer before every local engine is ready.

Ranks of this server on other hosts (``--headless`` nodes) write on their
own host; their losses reach this API server all the same, since a lost
link re-forms the whole session and takes every rank's link down.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

#: nanoseconds after a change during which the directory is read on every
#: request: changes within one tick of the file system's clock (a few ms) can
#: leave its modification time as it was
SETTLE_NS = 100_000_000


@dataclass(frozen=True)
class LinkState:
    """One attention rank's link to the FFN rank that serves it.

    Attributes:
        attention_rank: the rank.
        ffn_rank: the FFN rank that serves it.
        up: exchanging now.
        why: what happened to the FFN rank ("" while up).
        since: when the state began (``time.time()``).
        losses: how often the FFN rank was lost since the server started.
        rejoins: how often it came back.
    """

    attention_rank: int
    ffn_rank: int
    up: bool
    why: str = ""
    since: float = 0.0
    losses: int = 0
    rejoins: int = 0

    def describe(self) -> str:
        """One sentence for a client or an operator."""
        if self.up:
            return f"attention rank {self.attention_rank}: ffn rank {self.ffn_rank} up"
        gone = time.time() - self.since
        return (
            f"ffn rank {self.ffn_rank} (serving attention rank "
            f"{self.attention_rank}) is unavailable for {gone:.0f}s: {self.why}"
        )


def status_dir(server_pid: int) -> Path:
    """Where the ranks of the server with pid ``server_pid`` write."""
    return Path(tempfile.gettempdir()) / f"vllm-afd-{server_pid}"


def publish(server_pid: int, state: LinkState) -> None:
    """Write ``state`` as the rank's file (atomically: write, then rename)."""
    folder = status_dir(server_pid)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"attention-{state.attention_rank}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(state)))
    os.replace(tmp, path)


def read(server_pid: int) -> list[LinkState]:
    """Every rank's last state, by rank; [] before any rank wrote."""
    states = []
    for path in sorted(status_dir(server_pid).glob("attention-*.json")):
        with contextlib.suppress(OSError, ValueError, TypeError):
            states.append(LinkState(**json.loads(path.read_text())))
    return sorted(states, key=lambda s: s.attention_rank)


def reset(server_pid: int) -> None:
    """Remove the server's directory (at start: a pid may be reused)."""
    shutil.rmtree(status_dir(server_pid), ignore_errors=True)


class StatusReader:
    """The API server's view: read again whenever the directory changed (one
    ``stat`` per call otherwise)."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self._dir = status_dir(server_pid)
        self._stamp: int | None = None  # the directory's mtime when last read
        self._settled = False  # that read began SETTLE_NS after the change
        self._states: list[LinkState] = []

    def states(self) -> list[LinkState]:
        try:
            stamp: int | None = os.stat(self._dir).st_mtime_ns
        except OSError:
            stamp = None
        if stamp != self._stamp or not self._settled:
            began = time.time_ns()
            self._states, self._stamp = read(self.server_pid), stamp
            # A later change moves the mtime unless it fell in the tick of
            # ``stamp``; once a read began past that tick, none can.
            self._settled = stamp is None or began - stamp >= SETTLE_NS
        return self._states

    def down(self) -> list[LinkState]:
        """The ranks whose FFN rank is unavailable now."""
        return [s for s in self.states() if not s.up]
