"""Measure a model's decode parts on this machine (``vllm-afd plan``).

The parts the decode model needs (``cli.plan_model``) come from real servers
running the user's model with vLLM's own kernels: a 1A1F AFD deployment and
plain vLLM, one after the other, each answering ``b`` concurrent requests of
``c`` prompt tokens for every (context, batch) point. Per point, on the AFD
side, the workload runs twice — 2 output tokens, then ``decode_tokens`` —
and the AFD counters' difference between the two runs is the decode steps
alone (prefill cancels out)::

    T_f = d(afd_ffn_compute_seconds, FFN) / d(afd_steps)
    W   = d(afd_connector_wait_seconds, attention) / d(afd_steps)
    T_c = max(W - T_f, 0)
    T_a = max(median TPOT - max(W, T_f), 0)

so T_a + T_c + T_f is the measured 1A1F step whenever W >= T_f. (W < T_f
happens on shared cores: the FFN output can be there before the attention
asks for it.)

Plain vLLM's median TPOT at the point is the colocated step T_p. The KV
capacity of each comes from vLLM's start-up line ``KV cache size: N tokens``.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO

from vllm_afd.cli.bench import settled_counters
from vllm_afd.cli.bench_workload import (
    Request,
    build_requests,
    model_info,
    run_requests,
    timed_request,
)
from vllm_afd.cli.launch import Deployment, DeploymentSpec, PlainServer
from vllm_afd.cli.plan_model import Curve, Profile
from vllm_afd.models.layout import parse_model_line

KV_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")


class LogWatch:
    """A log sink that remembers what ``plan`` reads from role logs: each
    role's KV capacity and the attention role's model split."""

    def __init__(self, also: IO[str] | None = None) -> None:
        self.also = also
        self.kv_tokens: dict[str, int] = {}
        self.split: dict | None = None
        self.tail: list[str] = []
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self.tail = [*self.tail[-59:], text]
            match = KV_LINE.search(text)
            if match:
                role = text.split("]", 1)[0].lstrip("[") if text.startswith("[") else ""
                self.kv_tokens[role] = int(match.group(1).replace(",", ""))
            if self.split is None and "AFD attention model: split" in text:
                parsed = parse_model_line(text)
                if parsed is not None:
                    self.split = parsed[1]
            if self.also is not None:
                self.also.write(text)
        return len(text)

    def flush(self) -> None:
        if self.also is not None:
            self.also.flush()

    def kv_of(self, role: str) -> int | None:
        """The smallest KV capacity logged by a role whose prefix has ``role``."""
        seen = [v for k, v in self.kv_tokens.items() if role in k]
        return min(seen) if seen else None


@dataclass(frozen=True)
class Point:
    """One measured (context, batch): per decode step, seconds."""

    context: int
    batch: int
    tpot_s: float
    wait_s: float = 0.0  # attention wait per step (AFD)
    ffn_s: float = 0.0  # FFN compute per step (AFD)
    ffn_tokens: float = 0.0  # FFN tokens per step (AFD; ~ batch)


def _requests(
    url: str, served: str, context: int, batch: int, out: int, seed: int
) -> list[Request]:
    return build_requests(url, served, [context] * batch, [out] * batch, seed)


def _tpot(url: str, served: str, reqs: list[Request], what: str) -> tuple[float, int]:
    run = run_requests(
        what, url, served, reqs, concurrency=len(reqs), rate=None, seed=0,
        progress=False,
    )  # fmt: skip
    failed = [r.error for r in run.requests if r.error]
    if failed:
        raise RuntimeError(f"{what}: {len(failed)} request(s) failed: {failed[0]}")
    tpots = [r.tpot_s for r in run.requests if r.tpot_s is not None]
    return statistics.median(tpots), len(tpots)


def measure_afd_point(
    url: str, ffn_urls: list[str], served: str, context: int, batch: int,
    decode_tokens: int, seed: int,
) -> Point:  # fmt: skip
    """T_a, T_f and the round trip of one point (see the module doc)."""
    what = f"AFD c={context} b={batch}"
    short = _requests(url, served, context, batch, 2, seed)
    long = _requests(url, served, context, batch, decode_tokens, seed + 1)
    c0 = settled_counters(url, ffn_urls)
    _tpot(url, served, short, what)
    c1 = settled_counters(url, ffn_urls)
    tpot, _ = _tpot(url, served, long, what)
    c2 = settled_counters(url, ffn_urls)

    def d(name: str, role: str) -> float:
        def total(c: dict) -> float:
            return sum(v for (n, r, _), v in c.items() if n == name and r == role)

        return (total(c2) - total(c1)) - (total(c1) - total(c0))

    steps = d("afd_steps", "attention")
    if steps <= 0:
        raise RuntimeError(
            f"{what}: the AFD counters show no decode steps (afd_steps did not "
            "grow); is /metrics of the attention and FFN servers reachable?"
        )
    ffn_steps = d("afd_steps", "ffn") or steps
    return Point(
        context, batch, tpot,
        wait_s=d("afd_connector_wait_seconds", "attention") / steps,
        ffn_s=d("afd_ffn_compute_seconds", "ffn") / ffn_steps,
        ffn_tokens=d("afd_ffn_tokens", "ffn") / ffn_steps,
    )  # fmt: skip


def measure_plain_point(
    url: str, served: str, context: int, batch: int, decode_tokens: int, seed: int
) -> Point:
    reqs = _requests(url, served, context, batch, decode_tokens, seed + 1)
    tpot, _ = _tpot(url, served, reqs, f"plain c={context} b={batch}")
    return Point(context, batch, tpot)


def median_point(points: Sequence[Point]) -> Point:
    """Each figure's median over repeated measurements of one point."""
    first = points[0]
    return Point(
        first.context, first.batch,
        *(statistics.median(getattr(p, f) for p in points)
          for f in ("tpot_s", "wait_s", "ffn_s", "ffn_tokens")),
    )  # fmt: skip


def _check_lengths(url: str, contexts: Sequence[int], decode_tokens: int) -> str:
    served, max_len = model_info(url)
    longest = max(contexts) + decode_tokens
    if max_len is not None and longest > max_len:
        raise ValueError(
            f"--context-lens {max(contexts)} + {decode_tokens} decode tokens reach "
            f"{longest} tokens but the server's max_model_len is {max_len}; lower "
            "--context-lens or raise --max-model-len after `--`"
        )
    return served


def _warm(url: str, served: str, context: int) -> None:
    for req in _requests(url, served, context, 2, 4, seed=97):
        timed_request(url, served, req, stream=True)


def profile(
    spec: DeploymentSpec,
    contexts: Sequence[int],
    batches: Sequence[int],
    decode_tokens: int,
    platform: str,
    *,
    seed: int = 0,
    repeats: int = 1,
    log: LogWatch | None = None,
    note: Callable[[str], None] | None = None,
) -> tuple[Profile, list[Point], list[Point]]:
    """Measure every point on 1A1F AFD, then on plain vLLM (``spec``'s model
    and vLLM arguments), each ``repeats`` times (medians); the profile and
    the points."""
    log = log or LogWatch()
    say = note or (lambda s: print(f"vllm-afd plan: {s}", file=sys.stderr, flush=True))
    grid = [(c, b) for c in contexts for b in batches]
    afd_spec = dataclasses.replace(spec, attention_ranks=1, ffn_ranks=1, ubatches=1)
    afd_points, plain_points = [], []
    say("starting AFD 1A1F to measure both roles ...")
    dep = Deployment(afd_spec, log=log)
    dep.start(spec.ready_timeout_s)
    try:
        url, ffn_urls = dep.api_url, [p.url for p in dep.ffns]
        served = _check_lengths(url, contexts, decode_tokens)
        _warm(url, served, min(contexts))
        for i, (c, b) in enumerate(grid, 1):
            say(f"[{i}/{2 * len(grid)}] AFD 1A1F context {c} batch {b}")
            afd_points.append(median_point([
                measure_afd_point(url, ffn_urls, served, c, b, decode_tokens,
                                  seed + 10 * k)
                for k in range(repeats)
            ]))  # fmt: skip
    finally:
        dep.stop()
    split = log.split
    say("starting plain vLLM (colocated) ...")
    with PlainServer(spec, log=log) as plain:
        served = _check_lengths(plain.url, contexts, decode_tokens)
        _warm(plain.url, served, min(contexts))
        for i, (c, b) in enumerate(grid, len(grid) + 1):
            say(f"[{i}/{2 * len(grid)}] plain vLLM context {c} batch {b}")
            plain_points.append(median_point([
                measure_plain_point(plain.url, served, c, b, decode_tokens,
                                    seed + 10 * k)
                for k in range(repeats)
            ]))  # fmt: skip
    prof = build_profile(
        afd_points, plain_points, platform, decode_tokens,
        remote_layers=len(split["remote_layers"]) if split else 0,
        kv_attention=log.kv_of("attention"), kv_plain=log.kv_of("plain"),
    )  # fmt: skip
    return prof, afd_points, plain_points


def _own(p: Point) -> float:
    """T_a: the step less the round trip, which lasts at least T_f (the
    attention may find the FFN output there already when it asks: on shared
    cores the FFN can run while the attention is descheduled)."""
    return max(p.tpot_s - max(p.wait_s, p.ffn_s), 0.0)


def build_profile(
    afd: Sequence[Point],
    plain: Sequence[Point],
    platform: str,
    decode_tokens: int,
    *,
    remote_layers: int,
    kv_attention: int | None,
    kv_plain: int | None,
) -> Profile:
    """The model's curves from measured points (pure)."""
    contexts = sorted({p.context for p in afd})
    return Profile(
        platform=platform,
        remote_layers=remote_layers,
        decode_tokens=decode_tokens,
        attention={
            c: Curve.of((p.batch, _own(p)) for p in afd if p.context == c)
            for c in contexts
        },
        colocated={
            c: Curve.of((p.batch, p.tpot_s) for p in plain if p.context == c)
            for c in sorted({p.context for p in plain})
        },
        ffn=Curve.of((p.batch, p.ffn_s) for p in afd),
        comm=Curve.of((p.batch, max(p.wait_s - p.ffn_s, 0.0)) for p in afd),
        kv_tokens_attention=kv_attention,
        kv_tokens_colocated=kv_plain,
    )
