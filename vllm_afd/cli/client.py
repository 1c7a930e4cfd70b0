"""A small OpenAI-API client (standard library only) for the demo and bench."""

from __future__ import annotations

import json
import re
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


def post_json(url: str, body: dict[str, Any], timeout: float = 300.0) -> Any:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
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
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            parts.append(json.loads(line[5:])["choices"][0]["text"])
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
