"""The FFN role's API server refuses requests with an error that says why.

The FFN worker reports no supported tasks, so vLLM registers no generate
routes; without this middleware a completion request would get a bare
``404 Not Found``. Installed by the engine-config hook on the FFN role only
(wrapping vllm/entrypoints/launchers/app.py:init_entrypoints_middleware
@ 0.32.0). ``GET`` routes (``/health``, ``/metrics``) stay; ``GET /v1/models``
lists no model, since the FFN role serves none.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from vllm_afd.compat.patching import Patch, apply_patch
from vllm_afd.errors import FFN_SERVES_NO_REQUESTS

INIT_MIDDLEWARE = Patch(
    target="vllm.entrypoints.launchers.app:init_entrypoints_middleware",
    expected_params=("args", "app", "supported_tasks"),
    reason="answer requests sent to the FFN role with a clear error",
    removal="when vLLM lets a worker report why it serves no tasks",
)


class FFNRefusalMiddleware:
    """ASGI middleware: every non-GET HTTP request gets a 404 naming the role;
    ``GET /v1/models`` an empty list."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path") == "/v1/models":
            await _json(send, 200, {"object": "list", "data": []})
            return
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        await _json(
            send,
            404,
            {
                "error": {
                    "message": FFN_SERVES_NO_REQUESTS,
                    "type": "NotFoundError",
                    "code": 404,
                }
            },
        )


async def _json(send: Any, status: int, obj: dict) -> None:
    body = json.dumps(obj).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def init_entrypoints_middleware(args: Any, app: Any, supported_tasks: Any) -> None:
        original(args, app, supported_tasks)
        app.add_middleware(FFNRefusalMiddleware)

    return init_entrypoints_middleware


def install() -> None:
    """Install the refusal in this (FFN role's API server) process."""
    apply_patch(INIT_MIDDLEWARE, _wrap)
