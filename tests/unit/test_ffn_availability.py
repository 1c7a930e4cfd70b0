"""What the attention API server says while an FFN rank is missing: the
status files the ranks write, the ASGI middleware that reads them, and how
the engine core recognises a step that lost its FFN rank."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from vllm_afd.compat.engine_step import ffn_unavailable
from vllm_afd.errors import FFN_UNAVAILABLE, AFDFFNUnavailable
from vllm_afd.serving import ffn_status
from vllm_afd.serving.ffn_availability import FFNAvailabilityMiddleware
from vllm_afd.serving.ffn_status import LinkState, StatusReader


@pytest.fixture
def server_pid(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    pid = os.getpid()
    yield pid
    ffn_status.reset(pid)


def _down(rank: int, why: str = "ffn rank 0 closed its connection") -> LinkState:
    return LinkState(rank, 0, False, why, time.time() - 3, losses=1)


def test_status_files_round_trip_by_rank_and_reset(server_pid):
    assert ffn_status.read(server_pid) == []
    ffn_status.publish(server_pid, LinkState(1, 0, True))
    ffn_status.publish(server_pid, _down(0))
    states = ffn_status.read(server_pid)
    assert [s.attention_rank for s in states] == [0, 1]
    assert [s.up for s in states] == [False, True]
    ffn_status.publish(server_pid, LinkState(0, 0, True, rejoins=1))
    assert all(s.up for s in ffn_status.read(server_pid))
    assert not list(ffn_status.status_dir(server_pid).glob("*.tmp"))
    ffn_status.reset(server_pid)
    assert ffn_status.read(server_pid) == []


def test_every_api_server_process_sees_a_change_on_its_next_request(server_pid):
    """With data parallelism one API server process per local rank answers:
    none may answer from a state older than the last change (a 200 from one
    followed by a 503 from another for the same change). Changes come back
    to back (within one tick of the file system's clock), then after the
    directory settled."""
    readers = [StatusReader(server_pid) for _ in range(3)]
    for round_ in range(2):
        for k in range(20):
            up = k % 2 == 0
            ffn_status.publish(server_pid, LinkState(0, 0, True) if up else _down(0))
            for r in readers:
                assert bool(r.down()) is not up, (round_, k)
        # settled: each reader reads once more, then answers from memory
        time.sleep(ffn_status.SETTLE_NS / 1e9)
        for r in readers:
            assert r.down()
        assert all(r._settled for r in readers)


def test_describe_names_the_ffn_rank_and_why():
    text = _down(1, "ffn rank 0 sent no heartbeat for 4.1s").describe()
    assert text.startswith("ffn rank 0 (serving attention rank 1) is unavailable")
    assert text.endswith("ffn rank 0 sent no heartbeat for 4.1s")


async def _app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"vllm"})


def _call(middleware, method: str, path: str) -> tuple[int, dict | str]:
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "method": method, "path": path}
    asyncio.run(middleware(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent[1:])
    try:
        return sent[0]["status"], json.loads(body)
    except ValueError:
        return sent[0]["status"], body.decode()


@pytest.mark.parametrize(
    ("method", "path", "refused"),
    [
        ("GET", "/health", True),
        ("POST", "/v1/completions", True),
        ("POST", "/v1/chat/completions", True),
        ("GET", "/v1/models", False),
        ("GET", "/metrics", False),
        ("POST", "/tokenize", False),
    ],
)
def test_middleware_refuses_with_503_naming_the_rank_only_while_down(
    server_pid, method, path, refused
):
    reader = StatusReader(server_pid)
    middleware = FFNAvailabilityMiddleware(_app, reader)
    ffn_status.publish(server_pid, LinkState(0, 0, True))
    assert _call(middleware, method, path) == (200, "vllm")
    ffn_status.publish(server_pid, _down(0))
    status, body = _call(middleware, method, path)
    if not refused:
        assert (status, body) == (200, "vllm")
        return
    assert status == 503
    error = body["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
    assert error["ffn_ranks"] == [0]
    assert error["message"].startswith("AFD: ffn rank 0 unavailable")
    assert "ffn rank 0 closed its connection" in error["message"]


def test_afd_status_lists_every_rank(server_pid):
    middleware = FFNAvailabilityMiddleware(_app, StatusReader(server_pid))
    ffn_status.publish(server_pid, LinkState(0, 0, True))
    ffn_status.publish(server_pid, _down(1))
    status, body = _call(middleware, "GET", "/afd/status")
    assert status == 200 and body["ready"] is False
    assert [(r["attention_rank"], r["up"]) for r in body["ranks"]] == [
        (0, True),
        (1, False),
    ]


def test_the_engine_core_recognises_the_error_in_process_and_from_a_worker():
    err = AFDFFNUnavailable("ffn rank 0 closed its connection")
    assert (
        ffn_unavailable(err) == f"{FFN_UNAVAILABLE}: ffn rank 0 closed its connection"
    )
    # MultiprocExecutor turns a worker's exception into this string.
    wrapped = RuntimeError(
        f"Worker failed with error '{err}', please check the stack trace above "
        "for the root cause"
    )
    assert ffn_unavailable(wrapped) == str(err)
    try:
        try:
            raise err
        except AFDFFNUnavailable as inner:
            raise RuntimeError("step failed") from inner
    except RuntimeError as outer:
        assert ffn_unavailable(outer) == str(err)
    assert ffn_unavailable(RuntimeError("CUDA error: out of memory")) is None
