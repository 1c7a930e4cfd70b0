"""The FFN role's loop on the ``async`` connector: work items, no plans.

::

    while item := endpoint.next_item():      # any attention rank, arrival order
        out = compute(item.layer, rows, their top-k on this rank's experts)
        endpoint.reply(item, out)

Runs on a thread started by the FFN worker once the model is loaded, like
:class:`~vllm_afd.worker.ffn_loop.FFNLoop`, with the same counters (a
``step`` here is one work item).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

import torch

from vllm_afd.connector.async_ep import WorkItem
from vllm_afd.connector.payloads import A2FBatch
from vllm_afd.errors import AFDConnectorError
from vllm_afd.worker.compute_clock import ComputeClock, HostClock
from vllm_afd.worker.ffn_loop import ComputeFn, FFNLoopStats
from vllm_afd.worker.stall_watch import StallWatch

logger = logging.getLogger(__name__)


class WorkSource(Protocol):
    """What the loop needs of its endpoint (``connector.async_ep.AsyncFFN``)."""

    def next_item(self) -> WorkItem | None: ...

    def reply(self, item: WorkItem, out: torch.Tensor) -> None: ...

    def close(self, reason: str | None = None) -> None: ...


def describe_item(item: WorkItem) -> str:
    """A work item in the words of the stall log."""
    return (
        f"work item {item.seq} of attention rank {item.source} (layer "
        f"{item.layer}, {item.hidden.shape[0]} rows)"
    )


class AsyncFFNLoop:
    """Serves work items until every attention rank shut down, an error, or
    :meth:`stop`; the error is kept in :attr:`error` and handed to ``on_exit``."""

    def __init__(
        self,
        endpoint: WorkSource,
        compute: ComputeFn,
        *,
        on_exit: Callable[[BaseException | None], None] | None = None,
        clock: ComputeClock | None = None,
        watch: StallWatch | None = None,
    ) -> None:
        """``watch``: as for :class:`FFNLoop`, the unit a work item (in the
        words of :func:`describe_item`)."""
        self.endpoint = endpoint
        self.compute = compute
        self.on_exit = on_exit
        self.stats = FFNLoopStats(clock=clock or HostClock())
        self.error: BaseException | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.watch = watch

    def serve(self, item: WorkItem) -> None:
        """Compute one work item and reply."""
        watch = self.watch
        with self.stats.in_step:
            if watch is not None:
                watch.phase(item, "computing")
            with self.stats.clock.span():
                out = self.compute(item.layer, A2FBatch(item.hidden, item.routing))
            if watch is not None:
                watch.phase(item, "replying")
            self.endpoint.reply(item, out)
            if watch is not None:
                watch.idle()
            self.stats.steps += 1
            self.stats.tokens += item.hidden.shape[0]
            self.stats.last_batch_tokens = item.hidden.shape[0]

    def run(self) -> None:
        error: BaseException | None = None
        if self.watch is not None:
            self.watch.start()
        try:
            while not self._stopping.is_set():
                item = self.endpoint.next_item()
                if item is None:
                    logger.info("AFD async FFN loop: attention ranks shut down")
                    break
                self.serve(item)
        except BaseException as exc:  # kept, logged and handed to on_exit
            if not self._stopping.is_set():
                error = self.error = exc
                trace = None if isinstance(exc, AFDConnectorError) else exc
                logger.error("AFD async FFN loop failed: %s", exc, exc_info=trace)
        finally:
            if self.watch is not None:
                self.watch.stop()
            if self.on_exit is not None:
                self.on_exit(error)

    def start(self, name: str = "afd-async-ffn-loop") -> threading.Thread:
        self._thread = threading.Thread(target=self.run, name=name, daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop: close the endpoint (unblocks it) and join."""
        self._stopping.set()
        self.endpoint.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()
