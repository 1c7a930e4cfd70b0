"""From measured points to the model's curves (``vllm-afd plan``; pure).

A point (``cli.plan_profile``) is one measured (context, batch): the decode
``step`` and, on the AFD side, the counters' differences per decode step::

    T_f = min(d(afd_ffn_compute_seconds, FFN) / d(afd_steps), step)
    W   = min(d(afd_connector_wait_seconds, attention) / d(afd_steps), step)
    T_c = max(W - T_f, 0)
    T_a = max(step - max(W, T_f), 0)

so T_a + T_c + T_f is the measured 1A1F step whenever W >= T_f. (W < T_f
happens on shared cores: the FFN output can be there before the attention
asks for it.) Neither part can exceed the step: a counter difference that
does holds a one-off stall of one run (on one GPU: a kernel compiled for a
prefill shape the long run met first).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_afd.cli.plan_model import Candidate, Curve, Profile, predict, sharing_cost


@dataclass(frozen=True)
class Point:
    """One measured (context, batch): per decode step, seconds."""

    context: int
    batch: int
    tpot_s: float
    wait_s: float = 0.0  # attention wait per step (AFD)
    ffn_s: float = 0.0  # FFN compute per step (AFD)
    ffn_tokens: float = 0.0  # FFN tokens per step (AFD; ~ batch)
    #: the step's spread over the repeated measurements: (max - min) / median
    spread: float = 0.0
    #: how many measurements the medians are of
    samples: int = 1


#: a point whose step spreads more than this over its repeats is measured
#: again (once, as many times more), then marked when it still does
SPREAD_LIMIT = 0.25


def median_point(points: Sequence[Point]) -> Point:
    """Each figure's median over repeated measurements of one point, and the
    step's spread over them."""
    first = points[0]
    steps = [p.tpot_s for p in points]
    middle = statistics.median(steps)
    medians = {
        f: statistics.median(getattr(p, f) for p in points)
        for f in ("tpot_s", "wait_s", "ffn_s", "ffn_tokens")
    }
    return Point(
        context=first.context,
        batch=first.batch,
        **medians,
        spread=(max(steps) - min(steps)) / middle if middle > 0 else 0.0,
        samples=len(points),
    )


def measure_point(measure: Callable[[int], Point], repeats: int) -> Point:
    """``measure(k)`` for k in ``0..repeats-1``, their :func:`median_point`;
    with 2 or more repeats whose step spreads more than ``SPREAD_LIMIT``,
    ``repeats`` more measurements (k from ``repeats`` on) join them once. The
    result's ``spread`` says whether it still does."""
    points = [measure(k) for k in range(repeats)]
    point = median_point(points)
    if repeats >= 2 and point.spread > SPREAD_LIMIT:
        points += [measure(k) for k in range(repeats, 2 * repeats)]
        point = median_point(points)
    return point


def _by_context(points: Sequence[Point]) -> dict[int, Curve]:
    """``{context: step(batch)}`` of plain vLLM's points."""
    return {
        c: Curve.of((p.batch, p.tpot_s) for p in points if p.context == c)
        for c in sorted({p.context for p in points})
    }


def _part(seconds: float, p: Point) -> float:
    """A counter's share of ``p``'s step: within [0, step] (see the module
    doc)."""
    return min(max(seconds, 0.0), p.tpot_s)


def _own(p: Point) -> float:
    """T_a: the step less the round trip, which lasts at least T_f (the
    attention may find the FFN output there already when it asks: on shared
    cores the FFN can run while the attention is descheduled)."""
    return p.tpot_s - max(_part(p.wait_s, p), _part(p.ffn_s, p))


def build_profile(
    afd: Sequence[Point],
    plain: Sequence[Point],
    platform: str,
    decode_tokens: int,
    *,
    shared: dict[int, Sequence[Point]] | None = None,
    ubatched: Sequence[Point] = (),
    remote_layers: int,
    kv_attention: int | None,
    kv_plain: int | None,
    tp: dict[int, Sequence[Point]] | None = None,
    kv_tp: dict[int, int | None] | None = None,
) -> Profile:
    """The model's curves from measured points (pure); ``shared``: kA1F's
    points by k (one device), ``ubatched``: 1A1F's with 2 micro-batches (one GPU),
    ``tp``: plain vLLM's points per tensor-parallel size."""
    contexts = sorted({p.context for p in afd})
    prof = Profile(
        platform=platform,
        remote_layers=remote_layers,
        decode_tokens=decode_tokens,
        attention={
            c: Curve.of((p.batch, _own(p)) for p in afd if p.context == c)
            for c in contexts
        },
        colocated=_by_context(plain),
        colocated_tp={n: _by_context(pts) for n, pts in (tp or {}).items()},
        kv_tokens_colocated_tp=dict(kv_tp or {}),
        ffn=Curve.of((p.batch, _part(p.ffn_s, p)) for p in afd),
        comm=Curve.of(
            (p.batch, max(_part(p.wait_s, p) - _part(p.ffn_s, p), 0.0)) for p in afd
        ),
        kv_tokens_attention=kv_attention,
        kv_tokens_colocated=kv_plain,
    )
    no_share = prof
    for k, pts in sorted((shared or {}).items()):
        # What attention rank k on the same device costs beyond its work: the
        # measured kA1F step less the model's sum without it, with the S of
        # ranks 2..k-1 fitted before (on one GPU the ranks overlap: negative,
        # never below -T_a).
        def fit(p: Point, k: int = k, before: Profile = prof) -> float:
            t_a = before.attention[p.context](p.batch)
            return (
                p.tpot_s
                - predict(no_share, Candidate(k, 1), p.context, p.batch).step_s
                - sharing_cost(before, k - 1, p.context, p.batch, t_a)
            )

        prof = dataclasses.replace(prof, sharing={**prof.sharing, k: _corrections(
            pts, fit, floor=lambda p: no_share.attention[p.context](p.batch),
        )})  # fmt: skip
    if ubatched:
        # What a second micro-batch changes: the 1A1F step with two less
        # the 1A1F step with one, both measured.
        one = {(p.context, p.batch): p.tpot_s for p in afd}
        prof = dataclasses.replace(prof, ubatching=_corrections(
            ubatched, lambda p: p.tpot_s - one[p.context, p.batch]))  # fmt: skip
    return prof


def _corrections(
    points: Sequence[Point],
    value: Callable[[Point], float],
    floor: Callable[[Point], float] | None = None,
) -> dict[int, Curve]:
    """``{context: signed curve of value(point) over batch}``, each value
    not below ``-floor(point)`` when given."""

    def v(p: Point) -> float:
        return value(p) if floor is None else max(value(p), -floor(p))

    return {
        c: Curve.of(((p.batch, v(p)) for p in points if p.context == c), signed=True)
        for c in sorted({p.context for p in points})
    }
