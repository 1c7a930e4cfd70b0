"""Where an FFN rank stands when its own part of a step stalls.

A step whose FFN rank does not answer leaves the attention ranks waiting
until their ``timeout_s`` runs out, and the errors they then log say only
that the reply never came. Whether the FFN rank was waiting for them or
stuck in its own work (computing, replying, capturing or replaying a graph)
is the question. The serving thread marks each phase of a step; a watcher
thread logs the serving thread's Python stack once one phase of its own
work has lasted ``after_s`` (half the connector's ``timeout_s``, so before
the attention ranks give up), and the phase's whole time once it ends.
Waiting for the attention ranks is not reported where the serving thread
waits for them (on the CPU; they report their own stalls). Two waits hide
inside phases of the FFN's own work: where the data plane waits on the GPU
(``nccl``, ``cuda_ipc``), the host runs ahead and a late attention rank can
at most hold a later launch once the device queue is full (the report then
says so); and an ``async`` reply's
send blocks while an attention rank reads nothing. A phase costs the
serving thread a tuple, a clock read and an uncontended lock; the watcher
wakes every ``after_s / 4``, and at least once a second::

    AFD ffn rank 0: step 161 (WARMUP, 96 tokens): layer 0, computing for
    30.0 s; the serving thread is at (most recent call last):
      ...
      File ".../ffn_loop.py", line …, in _serve
        out = self.compute(layer_idx, batch)
      ...
    AFD ffn rank 0: step 161 (WARMUP, 96 tokens): layer 0, computing ended
    after 61.3 s

A thread blocked in a call that keeps the GIL cannot be shown this way;
PyTorch's operators and Triton's kernel loads and launches release it.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: what the serving thread is doing: (since, step, what, layer, waiting)
_Phase = tuple[float, Any, str, int, bool]


class StallWatch:
    """Watches the phases of one serving thread's steps (module docstring).

    The serving thread calls :meth:`phase` as a step moves on and
    :meth:`idle` between steps. Both take a lock the watcher holds only
    while it reports a stalled phase, so a report and the line that ends it
    come in that order and show the same phase.
    """

    def __init__(
        self,
        who: str,
        after_s: float,
        describe: Callable[[Any], str] = str,
        note: str = "",
    ) -> None:
        """``who`` names the rank in the log; ``describe`` turns a step (what
        the serving thread passes to :meth:`phase`) into words, only when a
        phase is reported; ``note`` ends every report."""
        if after_s <= 0:
            raise ValueError(f"after_s={after_s} must be > 0")
        self.who, self.after_s, self.describe = who, after_s, describe
        self.note = note
        self._phase: _Phase | None = None
        self._reported: _Phase | None = None
        self._thread_id = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def phase(
        self, step: Any, what: str, layer: int = -1, waiting: bool = False
    ) -> None:
        """The calling thread starts ``what`` of ``step`` (at ``layer``, if
        not -1); ``waiting``: for the attention ranks (never reported)."""
        self._next((time.monotonic(), step, what, layer, waiting))

    def idle(self) -> None:
        """Between steps (waiting for the next one is never reported)."""
        self._next(None)

    def _next(self, phase: _Phase | None) -> None:
        with self._lock:
            done, self._phase = self._phase, phase
            if done is None or done is not self._reported:
                return
            self._reported = None
        logger.warning(
            "AFD %s: %s ended after %.1f s",
            self.who,
            self._words(done),
            time.monotonic() - done[0],
        )

    def _words(self, phase: _Phase) -> str:
        _, step, what, layer, _ = phase
        where = f"layer {layer}, " if layer >= 0 else ""
        return f"{self.describe(step)}: {where}{what}"

    def start(self) -> threading.Thread:
        """Start the watcher thread (a daemon; :meth:`stop` ends it). Called
        by the serving thread: its stack is the one reported."""
        self._thread_id = threading.get_ident()
        watcher = threading.Thread(
            target=self._watch, name="afd-stall-watch", daemon=True
        )
        watcher.start()
        return watcher

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        period = min(1.0, self.after_s / 4)
        while not self._stop.wait(period):
            with self._lock:
                now = self._phase
                if now is None or now[4] or now is self._reported:
                    continue
                ran = time.monotonic() - now[0]
                if ran < self.after_s:
                    continue
                self._reported = now
                self._report(now, ran)  # under the lock: the phase stays

    def _report(self, now: _Phase, ran: float) -> None:
        frame = sys._current_frames().get(self._thread_id)
        stack = "".join(traceback.format_stack(frame)) if frame else "(gone)"
        logger.warning(
            "AFD %s: %s for %.1f s%s; the serving thread is at (most recent "
            "call last):\n%s",
            self.who,
            self._words(now),
            ran,
            f" ({self.note})" if self.note else "",
            stack.rstrip("\n"),
        )
