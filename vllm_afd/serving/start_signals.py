"""SIGTERM and SIGINT take effect while an AFD server waits for its engine.

vLLM 0.32.0's API server installs a SIGTERM handler that interrupts its
start-up (``KeyboardInterrupt``), but while it waits for the engine's ready
message its main thread sits in one long zmq poll. A Python signal handler
runs only on the main thread, and the kernel may hand the signal to any
other thread, which does not interrupt that poll: the stop then waits until
the engine is up, which for a role waiting in the rendezvous may be never
(``connect_timeout_s``). While that start-up handler is in place, a helper
thread nudges the main thread with a no-op real-time signal every
:data:`NUDGE_S`; the poll returns, pyzmq runs the pending handler, and the
start-up is interrupted the way vLLM means it to be. Once the server installs
its serving handlers (uvicorn's) the nudging stops.
"""

from __future__ import annotations

import signal
import threading
import time

#: the no-op signal that wakes the main thread (not used by vLLM or torch)
NUDGE = signal.SIGRTMIN + 7
NUDGE_S = 0.5
#: vLLM waits this long for its engine at most (VLLM_ENGINE_READY_TIMEOUT_S)
MAX_NUDGING_S = 3600.0


_nudging: threading.Thread | None = None


def install() -> threading.Thread | None:
    """Start nudging, from the main thread of a process whose SIGTERM
    handler is a Python function; None where there is nothing to do.
    Idempotent while a nudging thread runs."""
    global _nudging
    if _nudging is not None and _nudging.is_alive():
        return _nudging
    if threading.current_thread() is not threading.main_thread():
        return None
    handler = signal.getsignal(signal.SIGTERM)
    if not callable(handler):
        return None
    signal.signal(NUDGE, _ignore)
    main = threading.main_thread().ident
    assert main is not None

    def nudge() -> None:
        end = time.monotonic() + MAX_NUDGING_S
        while signal.getsignal(signal.SIGTERM) is handler and time.monotonic() < end:
            time.sleep(NUDGE_S)
            try:
                signal.pthread_kill(main, NUDGE)
            except (ProcessLookupError, OSError):
                return

    _nudging = threading.Thread(target=nudge, name="afd-start-signals", daemon=True)
    _nudging.start()
    return _nudging


def _ignore(signum: int, frame: object) -> None:
    """The nudge itself does nothing; what matters is the interrupted wait."""
