"""An attention role's engine gets time to close its connector when it stops.

With vLLM 0.32.0's default ``--shutdown-timeout 0`` the process that runs the
engine cores SIGTERMs them and SIGKILLs what is left of them at once, their
worker processes with them. An AFD worker closes its connector on shutdown,
which sends SHUTDOWN to its peers: that is how an FFN rank tells a stop (its
attention peers shut down for good: it stops too, and its node's launcher
ends without restarting it) from a crash (it rejoins, or says its peer died).
Killed at once, a worker often sends nothing, and a stopped deployment looks
crashed to the FFN ranks on other hosts.

In the API server of an attention role, the engine processes get
:data:`ENGINE_STOP_GRACE_S` to exit by themselves when no request-drain time
was asked for (vLLM gives ROCm engines such a window for the same reason:
cleanup before the kill). A positive ``--shutdown-timeout`` is left as vLLM
uses it. The FFN role is left as vLLM stops it: an attention rank treats an
FFN rank's SHUTDOWN and its connection closing alike (lost; it rejoins).
Wraps ``vllm/v1/engine/utils.py:get_engine_process_shutdown_timeout``
@ 0.32.0.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_afd.compat.patching import Patch, apply_patch

#: seconds an attention role's engine processes get to exit before vLLM kills
#: them, when ``--shutdown-timeout`` is 0 (vLLM's default)
ENGINE_STOP_GRACE_S = 5.0

SHUTDOWN_TIMEOUT = Patch(
    target="vllm.v1.engine.utils:get_engine_process_shutdown_timeout",
    expected_params=("request_timeout", "process_timeout"),
    reason="a stopping AFD engine's workers get time to send SHUTDOWN to "
    "their connector peers before vLLM kills them",
    removal="when vLLM gives its engine processes a cleanup window on every "
    "platform, or lets a plugin set it",
)


def with_grace(original: Any) -> Any:
    """``original`` with at least :data:`ENGINE_STOP_GRACE_S` for the engine
    processes when no drain time was asked for (a shorter process timeout is
    raised to it; None, vLLM's own best-effort default, is kept)."""

    @functools.wraps(original)
    def get_engine_process_shutdown_timeout(
        request_timeout: float | None, process_timeout: float | None
    ) -> float | None:
        timeout = original(request_timeout, process_timeout)
        if not request_timeout and timeout is not None:
            return max(timeout, ENGINE_STOP_GRACE_S)
        return timeout

    return get_engine_process_shutdown_timeout


def install() -> None:
    """Wrap the engine-process shutdown timeout of this process (idempotent)."""
    apply_patch(SHUTDOWN_TIMEOUT, with_grace)
