"""Where role processes' output goes: a full log file per role, a short console.

Every line a role process prints is written, with its ``[role]`` prefix, to
that role's file in the deployment's log directory (when it has one) and to
the console sink. By default the console is a :class:`ConsoleFilter`: it lets
through only what a person running ``vllm-afd launch`` needs (errors, the
exception lines of tracebacks, AFD warnings and each role's AFD start-up
line); ``--verbose`` passes the console everything, as vLLM prints it.

A role that exits while it starts is reported by the first exception line
of its own output (:func:`is_exception_line`: the root cause, e.g. vLLM's
``ValueError: Available memory on node 0 ...``, not the generic
``RuntimeError: Engine core initialization failed`` that follows it) and
the path of its full log.
"""

from __future__ import annotations

import re
import tempfile
import threading
from pathlib import Path
from typing import IO, Protocol

#: vLLM's log prefix, ``LEVEL MM-DD HH:MM:SS [file.py:line] ``
_LOG_PREFIX = r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) [\d-]+ [\d:.]+ \[[^\]]*\]"
_PREFIX = re.compile(_LOG_PREFIX + " ?")
#: ``ValueError: ...``, ``torch.OutOfMemoryError: ...``, after vLLM's optional
#: process tag ``(VllmWorker-0 pid=12)`` and an ERROR or CRITICAL log prefix.
#: An exception logged at WARNING or below was handled (vLLM logs the
#: traceback of an optional kernel package that failed to import, e.g.
#: ``OSError: .../deep_gemm/_C_extension.abi3.so: undefined symbol``, and goes
#: on): it is never the cause of a failed start.
_ERROR_PREFIX = r"(ERROR|CRITICAL) [\d-]+ [\d:.]+ \[[^\]]*\]"
_EXCEPTION = re.compile(
    r"^(\([^()]*? pid=\d+\)\s*)?"
    rf"({_ERROR_PREFIX}\s*)?"
    r"(?P<exc>[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)): \S"
)
#: vLLM's generic wrappers of a worker's or engine's real error: never the cause
_GENERIC = (
    "Engine core initialization failed",
    "WorkerProc initialization failed",
    "See stack trace for root cause",
    "See root cause above",
)


def exception_of(line: str) -> str | None:
    """``Type: message`` when ``line`` (without its role prefix) ends a
    traceback with an exception, unless it is one of vLLM's generic wrappers
    that only point at the real error; None otherwise."""
    text = line.strip()
    match = _EXCEPTION.match(text)
    if match is None or any(g in text for g in _GENERIC):
        return None
    return text[match.start("exc") :]


def is_exception_line(line: str) -> bool:
    """Whether :func:`exception_of` finds an exception in ``line``."""
    return exception_of(line) is not None


def shown_on_console(line: str) -> bool:
    """Whether a role's log line (without its role prefix) is shown by
    default: errors (not the frames of the tracebacks vLLM logs line by line:
    the exception line that ends one is shown), exception lines, AFD warnings
    and AFD start-up lines."""
    if is_exception_line(line):
        return True
    if " ERROR " in line:
        match = _PREFIX.search(line)
        message = line[match.end() :] if match else line
        frame = message[:1].isspace() or message.startswith("Traceback")
        return not frame and message.strip("^~ \n") != ""
    if "AFD" not in line:
        return False
    return " WARNING " in line or "AFD connector up" in line


class TextSink(Protocol):
    """Where role output goes: a text stream, a :class:`ConsoleFilter`, a
    test's collector. Role pumps call it from their own threads."""

    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...


class ConsoleFilter:
    """A text sink that passes to ``out`` only the role lines
    :func:`shown_on_console` keeps (thread-safe: role pumps write at once)."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        body = text.split("] ", 1)[1] if text.startswith("[") else text
        if shown_on_console(body):
            with self._lock:
                self.out.write(text)
        return len(text)

    def flush(self) -> None:
        self.out.flush()


def new_log_dir() -> Path:
    """A fresh directory for a deployment's role logs (under the system's
    temporary directory)."""
    return Path(tempfile.mkdtemp(prefix="vllm-afd-logs-"))
