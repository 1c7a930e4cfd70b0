"""One line, not a traceback, when the engine stops under the API server.

vLLM 0.32.0's API server stops its engine core before it cancels the task
that reads the engine's outputs, so on a requested stop that task often
meets the engine gone and logs ``AsyncLLM output_handler failed.`` at ERROR
with an ``EngineDeadError`` traceback (plain ``vllm serve`` does the same on
SIGTERM). The traceback names no cause: ``EngineDeadError`` only says the
engine core is gone, and an engine that failed logs its own error first. In
the API server of an AFD role this filter turns that record, and only that
one, into an INFO line; any other exception there still logs as vLLM wrote it.
"""

from __future__ import annotations

import logging

#: the logger and message of the record this filter rewrites
LOGGER = "vllm.v1.engine.async_llm"
MESSAGE = "AsyncLLM output_handler failed."
#: what it becomes
STOPPED = (
    "AsyncLLM output handler stopped: the engine core is gone (stopped, or "
    "failed: then its own error is above)"
)


class EngineGoneFilter(logging.Filter):
    """Rewrites the output handler's ``EngineDeadError`` record."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.msg == MESSAGE and type(exc).__name__ == "EngineDeadError":
            record.msg, record.args = STOPPED, ()
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info = record.exc_text = None
        return True


#: the worker's record of an exception it hands to the engine core
WORKER_LOGGER = "vllm.v1.executor.multiproc_executor"
WORKER_MESSAGE = "WorkerProc hit an exception."


class FFNUnavailableFilter(logging.Filter):
    """Drops the worker's traceback of ``AFDFFNUnavailable``: the FFN link
    logged the loss (ERROR, naming the rank and why) and the engine core logs
    the requests it fails; the step raising it is how they are failed."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (
            record.msg == WORKER_MESSAGE and type(exc).__name__ == "AFDFFNUnavailable"
        )


_FILTER = EngineGoneFilter()
_WORKER_FILTER = FFNUnavailableFilter()


def install() -> None:
    """Add the filters to vLLM's loggers (idempotent)."""
    for name, f in ((LOGGER, _FILTER), (WORKER_LOGGER, _WORKER_FILTER)):
        log = logging.getLogger(name)
        if f not in log.filters:
            log.addFilter(f)
