"""The workload of ``vllm-afd bench``: lengths, prompts, timed requests.

Prompts are token ids (windows of a tokenized built-in text, tokenized by the
server under test through ``/tokenize``), so every request has exactly the
input length it was drawn with and AFD and the baseline see identical inputs.
Requests are greedy (temperature 0, ``ignore_eos``) and streamed with
``logprobs=1`` and ``return_tokens_as_token_ids``: the client times the first
and every later token (TTFT, TPOT) and keeps the output token ids to compare
AFD with the baseline. Standard library only.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_afd.cli.client import open_url, post_json, stream_event

#: the text prompt windows are cut from (tokenized once by the server)
CORPUS = (
    "Attention reads the context and keeps the cache; the feed-forward network "
    "stores what the model has learned. A mixture of experts layer sends each "
    "token to a few experts chosen by a router, which scores every expert, "
    "keeps the best ones and weights their outputs. The scheduler batches the "
    "requests of many users into one step, and every step of decoding adds one "
    "token to each running sequence. Once upon a time a little robot walked to "
    "the hill every morning, looked at the sky and mixed new colours for a "
    "painting of the river, the bridge and the town beyond it."
)


# ----------------------------------------------------------------- results
@dataclass(frozen=True)
class RequestResult:
    """One request as the client saw it (times in seconds)."""

    index: int
    input_len: int
    output_len: int
    token_ids: tuple[int, ...] = ()
    latency_s: float = 0.0
    ttft_s: float | None = None
    decode_s: float | None = None  # first token to last token
    error: str | None = None
    #: streamed only: per token after the first chunk, seconds since the
    #: token before it (a chunk of k tokens arriving dt after the one before
    #: gives k gaps of dt/k)
    token_gaps_s: tuple[float, ...] = ()

    @classmethod
    def failed(
        cls, index: int, input_len: int, output_len: int, exc: BaseException
    ) -> RequestResult:
        return cls(index, input_len, 0, error=f"{type(exc).__name__}: {exc}")

    @property
    def tpot_s(self) -> float | None:
        if self.decode_s is None or self.output_len < 2:
            return None
        return self.decode_s / (self.output_len - 1)


@dataclass(frozen=True)
class RunResult:
    """One workload run against one server."""

    name: str
    requests: tuple[RequestResult, ...]
    duration_s: float
    devices: int = 1
    client_cpu_s: float = 0.0

    @property
    def ok(self) -> tuple[RequestResult, ...]:
        return tuple(r for r in self.requests if r.error is None)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.ok)

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s else 0.0


# ----------------------------------------------------------------- lengths
@dataclass(frozen=True)
class LengthDist:
    """A length distribution: ``fixed:N``, ``uniform:A:B`` or ``jsonl:PATH``.

    ``uniform`` is inclusive of both ends. ``jsonl`` replays lengths in file
    order (cycling): each line is an integer or an object holding ``key``
    (``input_len`` or ``output_len``).
    """

    spec: str
    kind: str
    values: tuple[int, ...]

    def sample(self, n: int, rng: random.Random) -> list[int]:
        if self.kind == "fixed":
            return [self.values[0]] * n
        if self.kind == "uniform":
            low, high = self.values
            return [rng.randint(low, high) for _ in range(n)]
        return [self.values[i % len(self.values)] for i in range(n)]

    @property
    def max(self) -> int:
        return max(self.values)


def parse_lengths(spec: str, key: str) -> LengthDist:
    """Parse a ``--input-len`` / ``--output-len`` value; ValueError if bad."""
    kind, _, rest = spec.partition(":")
    try:
        if kind == "fixed":
            values: tuple[int, ...] = (int(rest),)
        elif kind == "uniform":
            low, high = (int(v) for v in rest.split(":"))
            if low > high:
                raise ValueError(f"{low} > {high}")
            values = (low, high)
        elif kind == "jsonl":
            values = _jsonl_lengths(Path(rest), key)
        else:
            raise ValueError(f"unknown kind {kind!r}")
    except (ValueError, OSError, KeyError, TypeError) as exc:
        raise ValueError(
            f"bad length distribution {spec!r} ({exc}); use fixed:N, "
            f"uniform:A:B or jsonl:PATH (lines: N or {{{key!r}: N}})"
        ) from None
    if not values or min(values) < 1:
        raise ValueError(f"length distribution {spec!r} needs lengths >= 1")
    return LengthDist(spec, kind, values)


def _jsonl_lengths(path: Path, key: str) -> tuple[int, ...]:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            out.append(int(item[key] if isinstance(item, dict) else item))
    return tuple(out)


# ----------------------------------------------------------------- prompts
@dataclass(frozen=True)
class Request:
    """One request of the workload: prompt token ids and output length;
    ``salt``, when set, is sent as vLLM's ``cache_salt``: the request shares
    no prefix-cache blocks with requests of another salt."""

    index: int
    prompt: tuple[int, ...]
    output_len: int
    salt: str | None = None


def model_info(url: str) -> tuple[str, int | None]:
    """(served model id, max_model_len) from ``/v1/models``."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as resp:
        entry = json.loads(resp.read())["data"][0]
    return entry["id"], entry.get("max_model_len")


def build_requests(
    url: str,
    model: str,
    input_lens: Sequence[int],
    output_lens: Sequence[int],
    seed: int,
) -> list[Request]:
    """Requests whose prompts are windows of :data:`CORPUS`, tokenized by ``url``."""
    pool = post_json(
        f"{url}/tokenize",
        {"model": model, "prompt": CORPUS, "add_special_tokens": False},
    )["tokens"]
    need = max(input_lens) + len(pool)
    ids = pool * (need // len(pool) + 1)
    rng = random.Random(seed)
    out = []
    for i, (n_in, n_out) in enumerate(zip(input_lens, output_lens, strict=True)):
        start = rng.randrange(len(pool))
        out.append(Request(i, tuple(ids[start : start + n_in]), n_out))
    return out


# ---------------------------------------------------------------- requests
def _body(model: str, req: Request, stream: bool) -> bytes:
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(req.prompt),
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    if req.salt is not None:
        body["cache_salt"] = req.salt
    if stream:
        body.update(logprobs=1, return_tokens_as_token_ids=True)
    return json.dumps(body).encode()


def _token_ids(choice: dict[str, Any]) -> list[int]:
    logprobs = choice.get("logprobs") or {}
    return [int(t.removeprefix("token_id:")) for t in logprobs.get("tokens") or ()]


def timed_request(
    url: str, model: str, req: Request, stream: bool, timeout: float = 600.0
) -> RequestResult:
    """Send one request; time it (per token when ``stream``)."""
    http = urllib.request.Request(
        f"{url}/v1/completions",
        data=_body(model, req, stream),
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    first: float | None = None
    last = start
    gaps: list[float] = []
    ids: list[int] = []
    n_out = 0
    try:
        with open_url(http, timeout) as resp:
            if not stream:
                n_out = json.loads(resp.read())["usage"]["completion_tokens"]
            for raw in resp if stream else ():
                event = stream_event(raw.decode().strip())
                for choice in event["choices"] if event is not None else ():
                    new = _token_ids(choice)
                    if not new:
                        continue
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps += [(now - last) / len(new)] * len(new)
                    last = now
                    ids += new
            n_out = n_out or len(ids)
    except (OSError, ValueError, KeyError) as exc:  # ServerError is an OSError
        return RequestResult.failed(req.index, len(req.prompt), req.output_len, exc)
    end = time.perf_counter()
    return RequestResult(
        index=req.index,
        input_len=len(req.prompt),
        output_len=n_out,
        token_ids=tuple(ids),
        latency_s=end - start,
        ttft_s=None if first is None else first - start,
        decode_s=None if first is None else end - first,
        token_gaps_s=tuple(gaps),
    )


class Progress:
    """A progress bar on stderr: tqdm when installed, else a plain text bar."""

    def __init__(self, total: int, label: str, enabled: bool = True) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.done = 0
        self._lock = threading.Lock()
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=label, unit="req", file=sys.stderr)
            except ImportError:
                self._draw()

    def update(self) -> None:
        with self._lock:
            self.done += 1
            if self._bar is not None:
                self._bar.update(1)
            elif self.enabled:
                self._draw()

    def _draw(self) -> None:
        width = 30
        filled = width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (width - filled)
        end = "\n" if self.done == self.total else ""
        print(
            f"\r{self.label} [{bar}] {self.done}/{self.total}",
            end=end,
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def arrival_offsets(n: int, rate: float | None, seed: int) -> list[float]:
    """Send times (s from start): all at 0, or a Poisson process of ``rate``/s."""
    if not rate:
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def run_requests(
    name: str,
    url: str,
    model: str,
    requests: Sequence[Request],
    *,
    concurrency: int | None,
    rate: float | None,
    seed: int,
    stream: bool = True,
    devices: int = 1,
    progress: bool = True,
    send: Callable[..., RequestResult] = timed_request,
) -> RunResult:
    """Run ``requests`` (at most ``concurrency`` in flight, arriving at ``rate``)."""
    offsets = arrival_offsets(len(requests), rate, seed)
    bar = Progress(len(requests), name, progress)
    results: list[RequestResult | None] = [None] * len(requests)

    def one(req: Request, at: float) -> None:
        delay = at - (time.perf_counter() - start)
        if delay > 0:
            time.sleep(delay)
        results[req.index] = send(url, model, req, stream)
        bar.update()

    workers = concurrency or len(requests)
    cpu0 = time.process_time()
    start = time.perf_counter()
    with ThreadPoolExecutor(max(workers, 1)) as pool:
        jobs = zip(requests, offsets, strict=True)
        for future in [pool.submit(one, req, at) for req, at in jobs]:
            future.result()
    duration = time.perf_counter() - start
    bar.close()
    return RunResult(
        name=name,
        requests=tuple(r for r in results if r is not None),
        duration_s=duration,
        devices=devices,
        client_cpu_s=time.process_time() - cpu0,
    )
