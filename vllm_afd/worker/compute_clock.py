"""How long the FFN role's compute takes, on the device that runs it.

On CPU a layer's work is done when its call returns, so host time around
the call is its time. On CUDA the call only launches kernels: host time
around it is launch time, and the kernels run later. :class:`CudaEventClock`
records a CUDA event on the compute stream before and after each span and
adds the elapsed device time once the end event has completed, without
synchronizing the loop: :meth:`CudaEventClock.seconds` counts the spans the
device has finished (a span still running is counted on a later read).

``afd_ffn_compute_seconds_total`` is read from the FFN loop's clock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

import torch


class ComputeClock(Protocol):
    """Times spans of compute work launched by one thread."""

    def span(self) -> AbstractContextManager[None]:
        """A context whose body's work is timed."""
        ...

    def seconds(self) -> float:
        """Total time of the spans finished so far."""
        ...


class HostClock:
    """Host time around each span: the work's time where it runs inside the
    call (CPU)."""

    def __init__(self) -> None:
        self._total = 0.0

    @contextmanager
    def span(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._total += time.perf_counter() - start

    def seconds(self) -> float:
        return self._total


class CudaEventClock:
    """Device time of each span: CUDA events on the current stream, read
    once they have completed. A span inside a CUDA graph capture is not
    timed (it runs nothing then).

    Args:
        max_pending: spans whose end has not completed that are kept; past
            it the oldest one is waited for (bounds memory when nobody
            reads the clock).
    """

    def __init__(self, max_pending: int = 1024) -> None:
        self._lock = threading.Lock()
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._free: list[torch.cuda.Event] = []
        self._total = 0.0
        self._max_pending = max_pending

    def _event(self) -> torch.cuda.Event:
        return self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)

    @contextmanager
    def span(self) -> Iterator[None]:
        if torch.cuda.is_current_stream_capturing():
            yield
            return
        with self._lock:
            start = self._event()
        start.record()
        try:
            yield
        finally:
            with self._lock:
                end = self._event()
            end.record()
            with self._lock:
                self._pending.append((start, end))
                if len(self._pending) > self._max_pending:
                    self._pending[0][1].synchronize()
                self._collect()

    def _collect(self) -> None:
        """Add the finished spans, oldest first (``_lock`` held)."""
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.popleft()
            self._total += start.elapsed_time(end) / 1e3
            self._free += (start, end)

    def seconds(self) -> float:
        with self._lock:
            self._collect()
            return self._total


def clock_for(device: torch.device) -> HostClock | CudaEventClock:
    """The clock of compute on ``device``."""
    return CudaEventClock() if device.type == "cuda" else HostClock()
