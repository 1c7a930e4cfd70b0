"""Measure a model's decode parts on this machine (``vllm-afd plan``).

The parts the decode model needs (``cli.plan_model``) come from real servers
running the user's model with vLLM's own kernels: a 1A1F AFD deployment and
plain vLLM, one after the other, each answering ``b`` concurrent requests of
``c`` prompt tokens for every (context, batch) point. Per point the workload
runs once untimed (warm-up), then twice, 2 output tokens, then
``decode_tokens``. The decode ``step`` is the median gap between two
streamed tokens of a request in the long run; on the AFD side the AFD
counters' differences between the two runs are decode steps alone (the same
prefill in both cancels out). ``cli.plan_fit`` turns the points into the
model's curves.

Plain vLLM's ``step`` at the point is the colocated T_p; with
``tp_baselines`` plain vLLM also runs with ``--tensor-parallel-size N`` for
each N (T_pN). The KV capacity of each comes from vLLM's start-up line
``KV cache size: N tokens``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import re
import statistics
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO

from vllm_afd.cli.bench import LogTail, settled_counters
from vllm_afd.cli.bench_workload import (
    Request,
    build_requests,
    model_info,
    run_requests,
)
from vllm_afd.cli.plan_fit import (
    SPREAD_LIMIT,
    Point,
    build_profile,
    measure_point,
)
from vllm_afd.cli.plan_model import Profile
from vllm_afd.deploy import Deployment, DeploymentSpec, LaunchError, PlainServer
from vllm_afd.deploy.commands import BIND_ENV, core_shares

KV_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")


class LogWatch(LogTail):
    """The bench's log sink (last lines, the attention role's model split),
    also remembering each role's KV capacity."""

    def __init__(
        self,
        also: IO[str] | None = None,
        owned: bool = False,
        log_dir: Path | None = None,
    ) -> None:
        super().__init__(also, owned, log_dir)
        self.kv_tokens: dict[str, int] = {}

    def write(self, text: str) -> int:
        match = KV_LINE.search(text)
        if match:
            role = text.split("]", 1)[0].lstrip("[") if text.startswith("[") else ""
            self.kv_tokens[role] = int(match.group(1).replace(",", ""))
        return super().write(text)

    def kv_of(self, role: str) -> int | None:
        """The smallest KV capacity logged by a role whose prefix has ``role``."""
        seen = [v for k, v in self.kv_tokens.items() if role in k]
        return min(seen) if seen else None


def _requests(
    url: str, served: str, context: int, batch: int, out: int, seed: int
) -> list[Request]:
    """``batch`` requests of ``context`` prompt tokens, each with a salt of its
    own: no request finds blocks of an earlier one in the prefix cache, so
    every run prefills all its prompts (else a run whose prompts an earlier
    run had cached would be cheaper, and a difference of two runs wrong)."""
    reqs = build_requests(url, served, [context] * batch, [out] * batch, seed)
    return [dataclasses.replace(r, salt=uuid.uuid4().hex) for r in reqs]


def _timed(
    url: str, served: str, reqs: list[Request], what: str
) -> tuple[float, list[float]]:
    """Wall seconds of ``reqs``, all in flight at once (streamed), and every
    request's token gaps (``RequestResult.token_gaps_s``) pooled."""
    run = run_requests(
        what, url, served, reqs, concurrency=len(reqs), rate=None, seed=0,
        progress=False,
    )  # fmt: skip
    failed = [r.error for r in run.requests if r.error]
    if failed:
        raise RuntimeError(f"{what}: {len(failed)} request(s) failed: {failed[0]}")
    return run.duration_s, [g for r in run.requests for g in r.token_gaps_s]


#: output tokens of the short run of a point (prefill and one decode step)
SHORT = 2

#: times a point whose long run was not slower than its short run is
#: measured before :func:`decode_step` gives up
ATTEMPTS = 3


def decode_step(
    url: str, served: str, n: int, context: int, decode_tokens: int, seed: int,
    what: str, between: Callable[[], None] | None = None,
    note: Callable[[str], None] | None = None,
) -> float:  # fmt: skip
    """Seconds per decode step of ``n`` concurrent sequences of ``context``
    tokens: the median gap between two tokens of a request streamed in a run
    of ``decode_tokens`` output tokens, over every request of the run. The
    median keeps a one-off stall (a kernel compiled for a new shape, a
    scheduler hiccup) out of the figure: on one GPU such stalls added 0.9 s
    and once 60 s to a run of 32 tokens.

    The long run is paired with a run of :data:`SHORT` output tokens just
    before it: ``between`` runs before, between and after the two (counter
    reads: their differences are decode steps alone, the same prefill in
    both cancelling out; the last three calls belong to the returned
    figure). A pair whose long run was not slower than its short one (a stall
    of the machine during the short one, which would spoil the counters) is
    measured again, up to :data:`ATTEMPTS` times, each retry told to
    ``note``. An untimed run like the long one goes first: the first batch of
    a shape can pay for kernel compilation or graph capture."""
    step = between or (lambda: None)
    warm = _requests(url, served, context, n, decode_tokens, seed - 1)
    _timed(url, served, warm, f"{what} (warm-up)")
    times: list[tuple[float, float]] = []
    for attempt in range(ATTEMPTS):
        sd = seed + 1000 * attempt
        short = _requests(url, served, context, n, SHORT, sd)
        long = _requests(url, served, context, n, decode_tokens, sd + 1)
        step()
        t_short, _ = _timed(url, served, short, what)
        step()
        t_long, gaps = _timed(url, served, long, what)
        step()
        if t_long > t_short and gaps:
            return statistics.median(gaps)
        times.append((t_long, t_short))
        if note and attempt + 1 < ATTEMPTS:
            note(
                f"{what}: {decode_tokens} output tokens took no longer than "
                f"{SHORT} ({t_long:.3f}s vs {t_short:.3f}s); measuring again "
                f"({attempt + 2} of {ATTEMPTS})"
            )
    pairs = ", ".join(f"{a:.3f}s vs {b:.3f}s" for a, b in times)
    raise RuntimeError(
        f"{what}: {decode_tokens} output tokens took no longer than {SHORT} in "
        f"{ATTEMPTS} tries ({pairs}): the machine is too noisy to time decode "
        "steps; raise --decode-tokens"
    )


#: how far the FFN tokens per decode step of a measured window may stray
#: from the point's batch before the point is measured again
BATCH_SLACK = 0.25


def measure_afd_point(
    url: str, ffn_urls: list[str], served: str, context: int, batch: int,
    decode_tokens: int, seed: int, note: Callable[[str], None] | None = None,
) -> Point:  # fmt: skip
    """T_a, T_f and the round trip of one point (see the module doc).

    The counters' window must hold decode steps of ``batch`` sequences: FFN
    tokens per step within :data:`BATCH_SLACK` of ``batch``, and a mean wait
    per step below the median step. A window whose requests met the server
    staggered (on a busy host the first ones decode alone for a while) holds
    smaller steps and would price another batch; one with a stall inside
    leaves no attention time. Either is measured again, up to
    :data:`ATTEMPTS` times, each retry told to ``note``; then the closest
    window is kept and ``note`` says so."""
    what = f"AFD c={context} b={batch}"
    tried: list[Point] = []
    for attempt in range(ATTEMPTS):
        point = _afd_window(
            url, ffn_urls, served, context, batch, decode_tokens,
            seed + 100_000 * attempt, what, note,
        )  # fmt: skip
        staggered = abs(point.ffn_tokens - batch) > BATCH_SLACK * batch
        # the mean wait per step (counters) above the median step (token
        # gaps): a stall inside the window, which leaves no attention time
        stalled = point.wait_s >= point.tpot_s
        if not staggered and not stalled:
            return point
        tried.append(point)
        if note is not None:
            again = attempt + 1 < ATTEMPTS
            why = (
                f"the FFN ran {point.ffn_tokens:.2f} tokens per decode step, not "
                f"{batch} (requests arrived staggered)" if staggered else
                f"the wait per step ({point.wait_s * 1e3:.2f} ms) reached the "
                f"step ({point.tpot_s * 1e3:.2f} ms): a stall in the window"
            )  # fmt: skip
            note(
                f"{what}: {why}; "
                + (f"measuring again ({attempt + 2} of {ATTEMPTS})" if again
                   else "keeping the closest of the tries")
            )  # fmt: skip
    return min(
        tried,
        key=lambda p: (p.wait_s >= p.tpot_s, abs(p.ffn_tokens - batch)),
    )


def _afd_window(
    url: str, ffn_urls: list[str], served: str, context: int, batch: int,
    decode_tokens: int, seed: int, what: str, note: Callable[[str], None] | None,
) -> Point:  # fmt: skip
    reads: list[dict] = []
    tpot = decode_step(
        url, served, batch, context, decode_tokens, seed, what,
        between=lambda: reads.append(settled_counters([url, *ffn_urls])), note=note,
    )  # fmt: skip
    c0, c1, c2 = reads[-3:]

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
    url: str, served: str, context: int, batch: int, decode_tokens: int, seed: int,
    note: Callable[[str], None] | None = None,
) -> Point:  # fmt: skip
    what = f"plain c={context} b={batch}"
    return Point(
        context, batch, decode_step(url, served, batch, context, decode_tokens,
                                    seed, what, note=note)
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


def warm_up(url: str, served: str, context: int, n: int) -> None:
    """``n`` short unmeasured requests of ``context`` tokens at once."""
    reqs = _requests(url, served, context, n, 4, seed=97)
    run_requests("warm-up", url, served, reqs, concurrency=n, rate=None, seed=0,
                 progress=False)  # fmt: skip


def _plain_measure(
    url: str, served: str, decode_tokens: int, say: Callable[[str], None]
) -> Callable[[int, int, int], Point]:
    """Measures a (context, batch, seed) point on the plain server at ``url``."""

    def measure(context: int, batch: int, seed: int) -> Point:
        return measure_plain_point(url, served, context, batch, decode_tokens, seed,
                                   say)  # fmt: skip

    return measure


def _step_measure(
    url: str, served: str, ranks: int, label: str, decode_tokens: int,
    say: Callable[[str], None],
) -> Callable[[int, int, int], Point]:  # fmt: skip
    """Measures a point by its decode step alone: ``ranks`` x the batch in
    flight on the deployment at ``url``."""

    def measure(context: int, batch: int, seed: int) -> Point:
        step = decode_step(url, served, ranks * batch, context, decode_tokens, seed,
                           f"{label} c={context} b={batch}", note=say)  # fmt: skip
        return Point(context, batch, step)

    return measure


def plain_batches(
    batches: Sequence[int], sharing_ranks: Sequence[int] = ()
) -> list[int]:
    """The batches plain vLLM (one device) is measured at: ``batches`` and,
    on a shared device, every ``k*b`` a kA1F deployment of ``sharing_ranks``
    holds there, so that each is compared with plain vLLM holding as many
    sequences (:func:`~vllm_afd.cli.plan_model.at_equal_batch`)."""
    return sorted({*batches, *(k * b for k in sharing_ranks for b in batches)})


def profile(
    spec: DeploymentSpec,
    contexts: Sequence[int],
    batches: Sequence[int],
    decode_tokens: int,
    platform: str,
    *,
    seed: int = 0,
    repeats: int = 1,
    tp_baselines: Sequence[int] = (),
    sharing_ranks: Sequence[int] = (),
    measure_ubatching: bool = False,
    log: LogWatch | None = None,
    note: Callable[[str], None] | None = None,
) -> tuple[Profile, dict[str, list[Point]]]:
    """Measure every point on 1A1F AFD, on plain vLLM (``spec``'s model and
    vLLM arguments; at :func:`plain_batches` too; also with each
    tensor-parallel size of ``tp_baselines``)
    and, for each k of ``sharing_ranks`` (every role on one device, and
    deployments of more than one attention rank to predict), on kA1F AFD, and with
    ``measure_ubatching`` (one GPU, micro-batches to predict) on 1A1F AFD with
    2 micro-batches, each ``repeats`` times (medians); the profile and the
    points by phase."""
    log = log or LogWatch()
    say = note or (lambda s: print(f"vllm-afd plan: {s}", file=sys.stderr, flush=True))
    grid = [(c, b) for c in contexts for b in batches]
    tp_phases = [f"plain_tp{n}" for n in tp_baselines]
    phases = [
        "afd", "plain", *tp_phases, *(f"shared{k}" for k in sharing_ranks),
        *(["ubatched"] if measure_ubatching else []),
    ]  # fmt: skip
    counter = itertools.count(1)
    points: dict[str, list[Point]] = {}

    plain_grid = [
        (c, b) for c in contexts for b in plain_batches(batches, sharing_ranks)
    ]
    total = len(grid) * (len(phases) - 1) + len(plain_grid)

    def each(
        name: str,
        measure: Callable[[int, int, int], Point],
        points: Sequence[tuple[int, int]] = (),
    ) -> list[Point]:
        out = []
        for c, b in points or grid:
            say(f"[{next(counter)}/{total}] {name} context {c} batch {b}")

            def once(k: int, c: int = c, b: int = b) -> Point:
                return measure(c, b, seed + 10 * k)

            point = measure_point(once, repeats)
            if point.samples > repeats:
                say(
                    f"{name} context {c} batch {b}: the step spread "
                    f"{point.spread:.0%} over {point.samples} measurements"
                    + (" (still wide: marked)" if point.spread > SPREAD_LIMIT else "")
                )
            out.append(point)
        return out  # fmt: skip

    say("starting AFD 1A1F to measure both roles ...")
    with _afd(spec, 1, log, contexts, decode_tokens) as (url, ffn_urls, served):
        points["afd"] = each("AFD 1A1F", lambda c, b, sd: measure_afd_point(
            url, ffn_urls, served, c, b, decode_tokens, sd, say))  # fmt: skip
    split = log.split
    for n in (1, *tp_baselines):
        what = "plain vLLM" if n == 1 else f"plain vLLM TP{n}"
        say(f"starting {what} (colocated) ...")
        with _plain(spec, n, log) as plain:
            served = _check_lengths(plain.url, contexts, decode_tokens)
            warm_up(plain.url, served, min(contexts), 2)
            points["plain" if n == 1 else f"plain_tp{n}"] = each(
                what,
                _plain_measure(plain.url, served, decode_tokens, say),
                plain_grid if n == 1 else grid,
            )
    # Phases timed by their step alone: (phase, attention ranks, micro-batches,
    # label, why)
    shared: list[int] = []
    for name, ranks, ubatches, label, why in (
        *((f"shared{k}", k, 1, f"AFD {k}A1F", f"what attention rank {k} costs "
           "the shared device") for k in sharing_ranks),
        ("ubatched", 1, 2, "AFD 1A1F m=2", "what 2 micro-batches change"),
    ):  # fmt: skip
        if name not in phases:
            continue
        sharing = name.startswith("shared")
        if sharing and len(shared) < sharing_ranks.index(ranks):
            say(f"{label} not measured: a deployment of fewer attention ranks failed")
            continue
        say(f"starting {label} to measure {why} ...")
        try:
            dep = _afd(spec, ranks, log, contexts, decode_tokens, ubatches=ubatches)
            with dep as (url, _, served):
                points[name] = each(
                    label, _step_measure(url, served, ranks, label, decode_tokens, say)
                )
        except (LaunchError, RuntimeError, OSError) as exc:
            if not sharing or not shared:
                raise
            why = (str(exc) or type(exc).__name__).splitlines()[0][:200]
            say(
                f"{label} failed ({why}): the profile "
                f"keeps S_k of {', '.join(f'{k}A1F' for k in shared)}, and a "
                "deployment of more attention ranks per FFN rank is charged "
                f"S_{shared[-1]} for each rank beyond (as beyond the budget); "
                "--no-cache measures again"
            )
            continue
        if sharing:
            shared.append(ranks)
    prof = build_profile(
        points["afd"], points["plain"], platform, decode_tokens,
        shared={k: points[f"shared{k}"] for k in shared},
        ubatched=points.get("ubatched", ()),
        remote_layers=len(split["remote_layers"]) if split else 0,
        kv_attention=log.kv_of("attention"), kv_plain=log.kv_of("plain"),
        tp={n: points[f"plain_tp{n}"] for n in tp_baselines},
        kv_tp={n: log.kv_of(_tp_name(n)) for n in tp_baselines},
    )  # fmt: skip
    return prof, points


def _tp_name(n: int) -> str:
    """The log prefix of the plain server with tensor parallelism ``n``
    (not containing "plain": ``LogWatch.kv_of`` matches by substring)."""
    return f"colocated-tp{n}"


def _plain(spec: DeploymentSpec, tp: int, log: LogWatch) -> PlainServer:
    """Plain vLLM on ``spec``, with ``--tensor-parallel-size tp`` when > 1
    (on GPUs ``0 .. tp-1``)."""
    if tp == 1:
        return PlainServer(spec, log=log, log_dir=log.log_dir)
    tp_spec = dataclasses.replace(
        spec, vllm_args=[*spec.vllm_args, "--tensor-parallel-size", str(tp)]
    )
    if spec.attention_devices is not None:  # GPUs: the first tp of them
        gpus = ",".join(str(i) for i in range(tp))
        tp_spec = dataclasses.replace(tp_spec, attention_devices=gpus, ffn_devices=None)
    server = PlainServer(tp_spec, log=log, name=_tp_name(tp), log_dir=log.log_dir)
    env = server.process.env
    if spec.attention_devices is None and BIND_ENV not in env:
        # vLLM's CPU workers bind per NUMA node, and refuse more workers
        # than nodes: give each its share of this process's cores
        env[BIND_ENV] = cpu_bind(tp, sorted(os.sched_getaffinity(0)))
    return server


def cpu_bind(workers: int, cores: Sequence[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``workers`` an equal,
    consecutive share of ``cores`` (e.g. ``0|1``)."""
    return "|".join(core_shares(workers, cores))


@contextlib.contextmanager
def _afd(
    spec: DeploymentSpec, ranks: int, log: LogWatch, contexts: Sequence[int],
    decode_tokens: int, ubatches: int = 1,
) -> Iterator[tuple[str, list[str], str]]:  # fmt: skip
    """A started ``ranks``A1F deployment with ``ubatches`` micro-batches:
    (API URL, FFN URLs, served model)."""
    dep = Deployment(
        dataclasses.replace(
            spec, attention_ranks=ranks, ffn_ranks=1, ubatches=ubatches
        ),
        log=log,
        log_dir=log.log_dir,
    )
    dep.start(spec.ready_timeout_s)
    try:
        served = _check_lengths(dep.api_url, contexts, decode_tokens)
        warm_up(dep.api_url, served, min(contexts), 2 * ranks)
        yield dep.api_url, [p.url for p in dep.ffns], served
    finally:
        dep.stop()
