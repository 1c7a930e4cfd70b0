"""Whether each attention rank of this server has its FFN rank, for its API.

An attention rank's engine runs in another process than the API server that
answers for it, so each rank's FFN link (``worker.ffn_link``) writes its state
to a small JSON file in a directory named after the server's pid
(``AFD_SERVER_PID``), replaced atomically on every change; the API server
reads the directory (at most every :data:`READ_EVERY_S`). A rank without a
file has not opened its link yet and counts as up: vLLM does not answer
before every local engine is ready.

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

#: seconds an API server reuses what it last read
READ_EVERY_S = 0.1


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
    """The API server's view, re-read at most every :data:`READ_EVERY_S`."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self._at = 0.0
        self._states: list[LinkState] = []

    def states(self) -> list[LinkState]:
        now = time.monotonic()
        if now - self._at >= READ_EVERY_S:
            self._states, self._at = read(self.server_pid), now
        return self._states

    def down(self) -> list[LinkState]:
        """The ranks whose FFN rank is unavailable now."""
        return [s for s in self.states() if not s.up]
