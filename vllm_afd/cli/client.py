"""A small OpenAI-API client (standard library only) for the demo and bench."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

DEMO_PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three laws of robotics are",
    "In 1969, the first humans",
    "A mixture of experts model routes each token",
)


class ServerError(OSError):
    """The server answered a request with an error: an HTTP error status, or
    an error event in place of a streamed chunk (the status was already
    sent). The message is the server's own. An ``OSError``, as urllib's
    ``HTTPError`` is, so that callers which handle a failed request keep
    handling it."""


def error_message(body: Any) -> str | None:
    """The message of an OpenAI-style error body, ``{"error": {"message":
    ...}}`` (vLLM's and the attention server's 503) or ``{"error": "..."}``;
    None when ``body`` is not an error."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return None if error is None else str(error)


def stream_event(line: str) -> dict[str, Any] | None:
    """One server-sent event line of a streamed completion: its chunk, or
    None for a line that carries none (a comment, ``[DONE]``).

    Raises:
        ServerError: the event is the server's error (vLLM ends a stream
            whose request failed with one).
    """
    if not line.startswith("data:") or line == "data: [DONE]":
        return None
    event = json.loads(line[5:])
    message = error_message(event)
    if message is not None:
        raise ServerError(f"the server ended the stream with an error: {message}")
    return event


def _http_error(exc: urllib.error.HTTPError) -> ServerError:
    try:
        message = error_message(json.loads(exc.read() or b"null"))
    except (OSError, ValueError):
        message = None
    return ServerError(f"HTTP {exc.code}: {message or exc.reason}")


def open_url(req: urllib.request.Request | str, timeout: float) -> Any:
    """``urllib.request.urlopen`` whose HTTP errors carry the server's message.

    Raises:
        ServerError: the server answered with an error status.
    """
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as exc:
        raise _http_error(exc) from None


def post_json(url: str, body: dict[str, Any], timeout: float = 300.0) -> Any:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with open_url(req, timeout) as resp:
        return json.loads(resp.read())


def served_model(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=30) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def complete(base_url: str, model: str, prompt: str, max_tokens: int) -> str:
    out = post_json(
        f"{base_url}/v1/completions",
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        },
    )
    return out["choices"][0]["text"]


def chat(base_url: str, model: str, message: str, max_tokens: int) -> str:
    out = post_json(
        f"{base_url}/v1/chat/completions",
        {
            "model": model,
            "messages": [{"role": "user", "content": message}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        },
    )
    return out["choices"][0]["message"]["content"]


def stream_complete(base_url: str, model: str, prompt: str, max_tokens: int) -> str:
    req = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(
            {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    parts = []
    with open_url(req, 300) as resp:
        for raw in resp:
            event = stream_event(raw.decode().strip())
            if event is not None:
                parts.append(event["choices"][0]["text"])
    return "".join(parts)


@dataclass(frozen=True)
class Answers:
    completions: tuple[str, ...]
    chat: str
    stream: str


def collect_answers(base_url: str, max_tokens: int) -> Answers:
    """Greedy answers to the demo prompts: concurrent completions, chat, stream."""
    model = served_model(base_url)
    with ThreadPoolExecutor(len(DEMO_PROMPTS)) as pool:
        texts = tuple(
            pool.map(lambda p: complete(base_url, model, p, max_tokens), DEMO_PROMPTS)
        )
    return Answers(
        completions=texts,
        chat=chat(base_url, model, "Say something about experts.", max_tokens),
        stream=stream_complete(base_url, model, DEMO_PROMPTS[0], max_tokens),
    )


_SAMPLE = re.compile(r"^(afd_[a-z0-9_]+)_total\{([^}]*)\}\s+([0-9.eE+-]+)$")


def afd_metrics(base_url: str) -> dict[tuple[str, str, str], float]:
    """AFD counters on ``/metrics``: {(name, role, rank): value}."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    found: dict[tuple[str, str, str], float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
        key = (match.group(1), labels.get("role", ""), labels.get("rank", ""))
        found[key] = found.get(key, 0.0) + float(match.group(3))
    return found


def per_step_figures(
    metrics: dict[tuple[str, str, str], float], role: str = "attention", rank: str = "0"
) -> dict[str, str]:
    """Per-step averages of one endpoint's AFD counters."""

    def get(name: str) -> float:
        return metrics.get((name, role, rank), 0.0)

    steps = get("afd_steps")
    if steps == 0:
        return {"steps": "0 (no AFD counters found on /metrics)"}
    return {
        "steps": f"{steps:.0f}",
        "A2F bytes / step": f"{get('afd_a2f_bytes') / steps:,.0f}",
        "F2A bytes / step": f"{get('afd_f2a_bytes') / steps:,.0f}",
        "connector wait / step": (
            f"{get('afd_connector_wait_seconds') / steps * 1e3:.3f} ms"
        ),
    }
