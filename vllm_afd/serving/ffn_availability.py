"""The attention role's API server says when an FFN rank is missing.

While any attention rank of this server has lost its FFN rank
(``serving.ffn_status``, written by the ranks' FFN links):

* ``GET /health`` answers ``503`` with the reason, so a load balancer or a
  readiness probe takes the server out of rotation; it answers as vLLM does
  again once the FFN rank has rejoined;
* every other request but ``GET`` ones, ``/tokenize`` and ``/detokenize``
  answers ``503`` at once, its message naming the missing FFN rank(s),
  instead of reaching an engine that cannot serve it.

``GET /afd/status`` (always ``200``) returns each rank's link state as JSON.
Installed by the engine-config hook on the attention role (wrapping
vllm/entrypoints/launchers/app.py:init_entrypoints_middleware @ 0.32.0).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
from typing import Any

from vllm_afd.compat.patching import Patch, apply_patch
from vllm_afd.serving.ffn_refusal import _json
from vllm_afd.serving.ffn_status import StatusReader, reset

INIT_MIDDLEWARE = Patch(
    target="vllm.entrypoints.launchers.app:init_entrypoints_middleware",
    expected_params=("args", "app", "supported_tasks"),
    reason="refuse requests (503) and fail /health while an FFN rank is missing",
    removal="when vLLM lets a plugin report readiness and refuse requests",
)

#: paths served while an FFN rank is missing (they never reach the model)
SERVED_WHEN_DOWN = frozenset({"/tokenize", "/detokenize"})
STATUS_PATH = "/afd/status"


def unavailable_message(down: list[Any]) -> str:
    """What a refused client reads: the missing rank(s) and why."""
    ranks = sorted({s.ffn_rank for s in down})
    names = ", ".join(f"ffn rank {r}" for r in ranks)
    detail = "; ".join(s.describe() for s in down)
    return (
        f"AFD: {names} unavailable, this attention server refuses requests until "
        f"it rejoins ({detail})"
    )


class FFNAvailabilityMiddleware:
    """ASGI middleware over the attention role's API (see the module doc)."""

    def __init__(self, app: Any, reader: StatusReader) -> None:
        self.app = app
        self.reader = reader

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope.get("path", ""), scope.get("method")
        if path == STATUS_PATH and method == "GET":
            states = self.reader.states()
            await _json(
                send,
                200,
                {
                    "ready": all(s.up for s in states),
                    "ranks": [dataclasses.asdict(s) for s in states],
                },
            )
            return
        guarded = path == "/health" or (
            method not in ("GET", "HEAD") and path not in SERVED_WHEN_DOWN
        )
        down = self.reader.down() if guarded else []
        if not down:
            await self.app(scope, receive, send)
            return
        await _json(
            send,
            503,
            {
                "error": {
                    "message": unavailable_message(down),
                    "type": "ServiceUnavailableError",
                    "code": 503,
                    "ffn_ranks": sorted({s.ffn_rank for s in down}),
                }
            },
        )


def _wrap(original: Any, reader: StatusReader) -> Any:
    @functools.wraps(original)
    def init_entrypoints_middleware(args: Any, app: Any, supported_tasks: Any) -> None:
        original(args, app, supported_tasks)
        app.add_middleware(FFNAvailabilityMiddleware, reader=reader)

    return init_entrypoints_middleware


def install(server_pid: int, *, owner: bool = True) -> None:
    """Install the middleware in this (attention role's API server) process,
    reading the status directory of the server ``server_pid``; its ``owner``
    (the process that starts the engines) empties it first and removes it at
    exit."""
    if owner:
        reset(server_pid)
        atexit.register(reset, server_pid)
    reader = StatusReader(server_pid)
    apply_patch(INIT_MIDDLEWARE, lambda original: _wrap(original, reader))
