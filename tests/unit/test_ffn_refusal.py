"""The FFN role's API server: no model listed, completions refused by name."""

from __future__ import annotations

import asyncio
import json

from vllm_afd.errors import FFN_SERVES_NO_REQUESTS
from vllm_afd.serving.ffn_refusal import FFNRefusalMiddleware


def _call(method: str, path: str) -> tuple[int | None, dict | None, bool]:
    """(status, JSON body, reached the app) of one request through the
    middleware in front of an app that answers 200 itself."""
    sent: list[dict] = []
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "method": method, "path": path}
    asyncio.run(FFNRefusalMiddleware(app)(scope, receive, send))
    if not sent:
        return None, None, bool(reached)
    body = json.loads(sent[1]["body"])
    return sent[0]["status"], body, bool(reached)


def test_ffn_lists_no_model():
    assert _call("GET", "/v1/models") == (200, {"object": "list", "data": []}, False)


def test_ffn_refuses_completions_naming_the_role():
    status, body, reached = _call("POST", "/v1/completions")
    assert status == 404 and not reached
    assert body["error"]["message"] == FFN_SERVES_NO_REQUESTS


def test_ffn_health_and_metrics_reach_vllm():
    for path in ("/health", "/metrics"):
        assert _call("GET", path) == (None, None, True)
