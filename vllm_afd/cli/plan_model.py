"""A model of AFD decode from measured step times (``vllm-afd plan``).

(Over 500 lines on purpose: one set of formulas, each next to the records
it reads, documented here as a whole.)

Inputs, per decode step and measured on a 1A1F deployment of the user's model
(``cli.plan_profile``), all in seconds::

    T_a(b, c)  the attention rank's own work for b sequences of context c
               (step time minus its waits on the FFN)
    T_f(t)     the FFN rank's compute for t tokens (the FFN role's counter)
    T_c(t)     the rest of the round trip for t tokens: transfer, FFN-side
               overhead (attention wait minus T_f)
    T_p(b, c)  plain vLLM's step (colocated: one device holds the whole model)

Every figure covers all remote layers of one step; per layer is that / L.

An xAyF deployment with m micro-batches, b sequences per attention rank:
FFN rank k serves n_k attention ranks (blocks of ceil(x/y) or floor(x/y),
``topology``), so its step has n*b tokens; the widest block sets the pace::

    separate devices (GPU), m = 1:  step = T_a(b) + T_c(b) + T_f(n*b)
    separate devices, m >= 2:       u = b/m, per micro-batch a = T_a(u),
                                    f = T_c(u) + T_f(n*u)
                                    step = m*max(a, f) + min(a, f)
    one device (CPU, one GPU):      the roles share the device, so the
                                    parts add up, corrected by what running
                                    them together was measured to cost:
                                    step = x*T_a(b) + T_c(b) + y*T_f(n*b)
                                           + S_2(b) + ... + S_x(b) + (m-1)*U(b)
    S_k(b, c): what the k-th attention rank costs a step beyond its own work,
    measured on kA1F as its step less the sum without S_k, for every k the
    device budget allows up to MAX_SHARED_RANKS (beyond: the last measured
    one). It grows with k where the ranks outnumber the cores: on two cores
    a second attention rank uses the core the first left idle while it waited
    on the FFN, a third finds none. On shared cores it is positive
    (scheduling, vLLM's data-parallel step sync, the FFN waiting for the
    later rank each layer: part of the communication figure); on one GPU the
    ranks' kernels overlap and it can be negative (part of the attention
    figure), never below -T_a(b) (a rank added never shortens the step).
    U(b, c): what each micro-batch beyond the first changes, measured on one
    GPU as the 1A1F step with 2 micro-batches less that with one (negative:
    the overlap gains more than the re-reads cost). Without it (not measured:
    CPU, no micro-batches) no m >= 2 is predicted on a shared device.

``T_f(n*u)`` at small ``u`` keeps its intercept (the expert weights read
once per call), so the model charges micro-batches their re-reads. Tokens
per second per device: ``x*b / step / (x+y)`` on GPUs; where every role
shares one device (a CPU host, one GPU) per that device (``x*b / step``).
The colocated baselines are plain vLLM on one device with data-parallel
replicas, ``b / T_p(b)`` per device, and, where
measured (``--tp-baselines``), plain vLLM with tensor parallelism N over N
devices, ``b / T_pN(b) / N`` per device (per host on shared cores:
``b / T_pN(b)``); the best that fits is the reference. Expert parallelism is
not modelled. A deployment is compared with plain vLLM twice: with the best
colocated baseline (its best measured batch that fits the KV capacity and
the TPOT SLO: "equal SLO"), and with plain vLLM holding as many sequences
per device (``equal_batch``: ``x*b`` on a shared device, where every rank's
sequences are on it; ``x*b / (x+y)`` on separate ones): on a device that
a small batch leaves idle plain vLLM runs a larger batch in little more
time, so a deployment holding more sequences is not faster for that. A batch
fits when ``b*(c + decode tokens)`` fits the KV capacity of the rank and the
step meets the TPOT SLO.

The device bound (shared devices only): the roles of a deployment on one
device do the work plain vLLM does there for the same sequences, and more
(the exchanges), so x attention ranks of b sequences cannot beat plain
vLLM's throughput at batch x*b on that device except by what running
processes side by side was measured to overlap::

    limit(b) = (x*b / T_p(x*b)) / (1 - o(b)) * (1 + BOUND_SLACK)
    o(b)     = the largest measured saving fraction: -S_k(b) over the kA1F
               parts it corrects (k*T_a(b) + T_c(b) + T_f(k*b)), -U(b) over
               the 1A1F parts; 0 where none is negative; at most MAX_OVERLAP

A prediction above ``limit`` breaks the bound: shown as such, never picked.

The scale model (``--target-devices N``): the same deployments on N separate
devices, from the parts measured here, with the measured round trip
replaced by a link of latency ``lat`` (one way) and bandwidth ``bw``::

    T_link(t) = L * (2*lat + t * bytes_per_token / bw)
    bytes_per_token = H * act_bytes * (1 + F2A parts) + 8 * top_k (gate on
                      attention: the routing's ids and weights)

and the separate-devices rows above (``T_c`` := ``T_link``, no ``S``, no
``U``): a prediction for hardware the parts were not measured on, labelled so.

Curves interpolate linearly between measured points and extrapolate from the
last two (never below zero); a context not measured takes the nearest
measured one. Pure: no vLLM, no I/O.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from vllm_afd.topology import Topology

#: platforms where every role shares one device: the model adds the parts
SHARED_PLATFORMS = ("cpu", "cuda-shared")
#: the most attention ranks a shared device's profile measures S_k on (one
#: deployment each); larger counts take S of the largest measured
MAX_SHARED_RANKS = 4
#: the device bound's allowance for measurement noise (the parts and plain
#: vLLM's steps are medians of separate runs)
BOUND_SLACK = 0.10
#: the most of a step the measured overlap may be taken to save
MAX_OVERLAP = 0.9


class Bound(enum.Enum):
    """What limits a step: the largest part of it."""

    ATTENTION = "attention"
    COMMUNICATION = "communication"
    FFN = "ffn"


@dataclass(frozen=True)
class Curve:
    """Seconds as a piecewise-linear function of a size (batch or tokens).

    Attributes:
        points: ``(size, seconds)`` sorted by size, sizes distinct.
    """

    points: tuple[tuple[float, float], ...]
    #: may go below zero (a correction, not a duration)
    signed: bool = False

    def __post_init__(self) -> None:
        sizes = [p[0] for p in self.points]
        if not sizes or sizes != sorted(set(sizes)):
            raise ValueError(f"a curve needs distinct sorted sizes, got {sizes}")

    def __call__(self, size: float) -> float:
        pts = self.points
        if len(pts) == 1:
            x0, y0 = pts[0]
            y = y0 * size / x0 if x0 and not self.signed else y0
        else:
            i = bisect.bisect_left([p[0] for p in pts], size)
            i = min(max(i, 1), len(pts) - 1)
            (x0, y0), (x1, y1) = pts[i - 1], pts[i]
            y = y0 + (y1 - y0) * (size - x0) / (x1 - x0)
        return y if self.signed else max(0.0, y)

    @classmethod
    def of(cls, pairs: Iterable[tuple[float, float]], signed: bool = False) -> Curve:
        """A curve of ``pairs``; repeated sizes average."""
        by: dict[float, list[float]] = {}
        for x, y in pairs:
            by.setdefault(float(x), []).append(float(y))
        return cls(tuple((x, sum(v) / len(v)) for x, v in sorted(by.items())), signed)


@dataclass(frozen=True)
class Profile:
    """What ``plan`` measured on one model and machine.

    Attributes:
        platform: ``cuda`` (roles on separate devices), ``cuda-shared``
            (every role on one GPU) or ``cpu`` (roles share one host's cores);
            ``separate``: the scale model's devices (:func:`on_separate_devices`);
            on the shared ones nothing overlaps and concurrent ranks add up.
        remote_layers: layers that cross the connector per step.
        decode_tokens: tokens each measured request generated.
        attention: ``{context: T_a(batch)}``.
        colocated: ``{context: T_p(batch)}``.
        ffn: ``T_f(tokens)``.
        comm: ``T_c(tokens)``.
        kv_tokens_attention: KV capacity (tokens) of one attention rank, if known.
        kv_tokens_colocated: of a plain vLLM rank, if known.
        sharing: one device only: ``{k: {context: S_k(batch)}}`` (signed),
            what the k-th attention rank costs a step on top of its work
            (measured on kA1F, k >= 2; empty: nothing).
        ubatching: one GPU only: ``{context: U(batch)}`` (signed), what each
            micro-batch beyond the first changes the step by (measured on
            1A1F with 2 micro-batches; empty: not measured, no m >= 2).
        colocated_tp: ``{N: {context: T_pN(batch)}}``, plain vLLM with
            tensor parallelism N (empty: not measured).
        kv_tokens_colocated_tp: ``{N: KV capacity}`` of those servers.
    """

    platform: str
    remote_layers: int
    decode_tokens: int
    attention: dict[int, Curve]
    colocated: dict[int, Curve]
    ffn: Curve
    comm: Curve
    kv_tokens_attention: int | None = None
    kv_tokens_colocated: int | None = None
    sharing: dict[int, dict[int, Curve]] = field(default_factory=dict)
    ubatching: dict[int, Curve] = field(default_factory=dict)
    colocated_tp: dict[int, dict[int, Curve]] = field(default_factory=dict)
    kv_tokens_colocated_tp: dict[int, int | None] = field(default_factory=dict)

    @property
    def shared_cores(self) -> bool:
        """Every role runs on one device (one host's cores, or one GPU)."""
        return self.platform in SHARED_PLATFORMS

    @property
    def unit(self) -> str:
        """What throughput is counted per."""
        return {"cpu": "tok/s/host", "cuda-shared": "tok/s/GPU"}.get(
            self.platform, "tok/s/device"
        )

    def to_json(self) -> dict:
        def c(curve: Curve) -> list[list[float]]:
            return [list(p) for p in curve.points]

        d = asdict(self)
        d["attention"] = {str(k): c(v) for k, v in self.attention.items()}
        d["colocated"] = {str(k): c(v) for k, v in self.colocated.items()}
        d["ffn"], d["comm"] = c(self.ffn), c(self.comm)
        d["sharing"] = {
            str(k): {str(ctx): c(v) for ctx, v in curves.items()}
            for k, curves in self.sharing.items()
        }
        d["ubatching"] = {str(k): c(v) for k, v in self.ubatching.items()}
        d["colocated_tp"] = {
            str(n): {str(k): c(v) for k, v in curves.items()}
            for n, curves in self.colocated_tp.items()
        }
        d["kv_tokens_colocated_tp"] = {
            str(n): kv for n, kv in self.kv_tokens_colocated_tp.items()
        }
        return d

    @classmethod
    def from_json(cls, d: dict) -> Profile:
        def c(points: list, signed: bool = False) -> Curve:
            return Curve(tuple((float(x), float(y)) for x, y in points), signed)

        return cls(
            platform=d["platform"],
            remote_layers=int(d["remote_layers"]),
            decode_tokens=int(d["decode_tokens"]),
            attention={int(k): c(v) for k, v in d["attention"].items()},
            colocated={int(k): c(v) for k, v in d["colocated"].items()},
            ffn=c(d["ffn"]),
            comm=c(d["comm"]),
            kv_tokens_attention=d.get("kv_tokens_attention"),
            kv_tokens_colocated=d.get("kv_tokens_colocated"),
            sharing={
                int(k): {int(ctx): c(v, True) for ctx, v in curves.items()}
                for k, curves in d.get("sharing", {}).items()
            },
            ubatching={int(k): c(v, True) for k, v in d.get("ubatching", {}).items()},
            colocated_tp={
                int(n): {int(k): c(v) for k, v in curves.items()}
                for n, curves in d.get("colocated_tp", {}).items()
            },
            kv_tokens_colocated_tp={
                int(n): kv for n, kv in d.get("kv_tokens_colocated_tp", {}).items()
            },
        )


@dataclass(frozen=True)
class Link:
    """The link between an attention and an FFN device the scale model
    charges: ``latency_s`` one way per message, ``bytes_per_s``, and the
    bytes one token moves per remote layer (both directions)."""

    latency_s: float
    bytes_per_s: float
    bytes_per_token: int

    def step_s(self, tokens: float, layers: int) -> float:
        """``T_link``: one step's exchanges of ``tokens`` over ``layers``."""
        each = 2 * self.latency_s + tokens * self.bytes_per_token / self.bytes_per_s
        return layers * each


def on_separate_devices(profile: Profile, link: Link, max_tokens: int) -> Profile:
    """``profile`` as every role on a device of its own would see it: the
    measured parts, the round trip charged by ``link`` (linear in the
    tokens, so two points up to ``max_tokens`` hold it), and nothing of what
    sharing one device cost or overlapped (no ``S``, no ``U``)."""
    sizes = (1.0, float(max(max_tokens, 2)))
    comm = Curve(tuple((t, link.step_s(t, profile.remote_layers)) for t in sizes))
    return dataclasses.replace(
        profile, platform="separate", comm=comm, sharing={}, ubatching={}
    )


def _nearest(curves: dict[int, Curve], context: int) -> Curve:
    return curves[min(curves, key=lambda c: (abs(c - context), c))]


@dataclass(frozen=True)
class Candidate:
    """One deployment: x attention ranks, y FFN ranks, m micro-batches."""

    attention_ranks: int
    ffn_ranks: int
    ubatches: int = 1

    @property
    def name(self) -> str:
        m = f" m={self.ubatches}" if self.ubatches > 1 else ""
        return f"{self.attention_ranks}A{self.ffn_ranks}F{m}"

    @property
    def devices(self) -> int:
        return self.attention_ranks + self.ffn_ranks

    @property
    def widest_block(self) -> int:
        """Attention ranks of the busiest FFN rank."""
        return Topology(self.attention_ranks, self.ffn_ranks).ratio


@dataclass(frozen=True)
class Prediction:
    """A predicted decode step (seconds) and its throughput.

    ``attention_s``/``comm_s``/``ffn_s`` are the parts as the model adds
    them (before any overlap); ``step_s`` is the step; ``candidate`` the
    deployment (None: the colocated baseline).
    """

    name: str
    context: int
    batch: int
    step_s: float
    attention_s: float
    comm_s: float
    ffn_s: float
    tokens_per_s_per_device: float
    bound: Bound | None = None
    fits: bool = True
    why_not: str = ""
    candidate: Candidate | None = None
    #: why it breaks the device bound ("" when it does not)
    over_bound: str = ""

    def to_json(self) -> dict:
        d = asdict(self)
        d["bound"] = self.bound.value if self.bound else None
        return d


def predict(profile: Profile, cand: Candidate, context: int, batch: int) -> Prediction:
    """The step of ``cand`` at ``batch`` sequences per attention rank."""
    x, y, m = cand.attention_ranks, cand.ffn_ranks, cand.ubatches
    n, u = cand.widest_block, batch / m
    if profile.shared_cores:
        if m > 1 and not profile.ubatching:
            raise ValueError(
                f"{cand.name}: micro-batches on a shared device need the "
                "profile's measured U (ubatching); none was measured"
            )
        t_a = _nearest(profile.attention, context)(batch)
        t_c, t_f = profile.comm(batch), profile.ffn(n * batch)
        share = sharing_cost(profile, x, context, batch, t_a)
        a = x * t_a + min(share, 0.0)
        c = t_c + max(share, 0.0)
        f = y * t_f
        step = a + c + f
        if m > 1:
            # measured at m = 2; the overlap hides at most the smaller side
            ub = (m - 1) * _correction(profile.ubatching, context, batch, None)
            step = max(step + ub, a, c + f)
            a, c = a + min(ub, 0.0), c + max(ub, 0.0)
        per_device = x * batch / step
    else:
        t_a = _nearest(profile.attention, context)(u)
        t_c, t_f = profile.comm(u), profile.ffn(n * u)
        a, c, f = m * t_a, m * t_c, m * t_f
        if m == 1:
            step = t_a + t_c + t_f
        else:
            step = m * max(t_a, t_c + t_f) + min(t_a, t_c + t_f)
        per_device = x * batch / step / cand.devices
    parts = {Bound.ATTENTION: a, Bound.COMMUNICATION: c, Bound.FFN: f}
    return Prediction(
        cand.name, context, batch, step, a, c, f, per_device,
        bound=max(parts, key=parts.__getitem__), candidate=cand,
    )  # fmt: skip


def sharing_cost(
    profile: Profile, ranks: int, context: int, batch: int, t_a: float
) -> float:
    """``S_2 + ... + S_ranks`` at ``batch`` (each not below ``-t_a``): what
    attention ranks 2..``ranks`` cost a shared device beyond their work; a
    rank count beyond the measured ones takes the largest measured."""
    measured = sorted(profile.sharing)
    total = 0.0
    for k in range(2, ranks + 1):
        known = [r for r in measured if r <= k]
        if known:
            total += _correction(profile.sharing[known[-1]], context, batch, t_a)
    return total


def _correction(
    curves: dict[int, Curve], context: int, batch: int, floor_s: float | None
) -> float:
    """A measured signed correction at ``batch`` (0 if not measured), not
    below ``-floor_s`` when given."""
    if not curves:
        return 0.0
    value = _nearest(curves, context)(batch)
    return value if floor_s is None else max(value, -floor_s)


def measured_overlap(profile: Profile, context: int, batch: int) -> float:
    """``o(b)``: the largest fraction of a step that running processes side
    by side on the shared device was measured to save (0: none)."""
    t_a = _nearest(profile.attention, context)(batch)
    t_c = profile.comm(batch)
    savings = [
        -_correction(curves, context, batch, None)
        / (k * t_a + t_c + profile.ffn(k * batch))
        for k, curves in profile.sharing.items()
    ]
    if profile.ubatching:
        parts = t_a + t_c + profile.ffn(batch)
        savings.append(-_correction(profile.ubatching, context, batch, None) / parts)
    return min(max([0.0, *savings]), MAX_OVERLAP)


def device_limit(
    profile: Profile, cand: Candidate, context: int, batch: int
) -> tuple[float, float] | None:
    """On a shared device: the most tokens/s ``cand`` can give at ``batch``
    (``limit(b)``, slack included) and the overlap ``o(b)`` it allows; None
    on separate devices or where plain vLLM was not measured."""
    if not profile.shared_cores or not profile.colocated:
        return None
    total = cand.attention_ranks * batch
    plain_step = _nearest(profile.colocated, context)(total)
    if plain_step <= 0:
        return None
    overlap = measured_overlap(profile, context, batch)
    return total / plain_step / (1 - overlap) * (1 + BOUND_SLACK), overlap


def bounded(profile: Profile, p: Prediction) -> Prediction:
    """``p``, marked when it breaks the device bound (and then unfit)."""
    if p.candidate is None:
        return p
    limit = device_limit(profile, p.candidate, p.context, p.batch)
    if limit is None or p.tokens_per_s_per_device <= limit[0]:
        return p
    total = p.candidate.attention_ranks * p.batch
    why = (
        f"breaks the device bound: {p.tokens_per_s_per_device:.1f} {profile.unit} "
        f"predicted, at most {limit[0]:.1f} possible (plain vLLM at batch "
        f"{total} on this device, {limit[1]:.0%} measured overlap, "
        f"{BOUND_SLACK:.0%} slack)"
    )
    return dataclasses.replace(p, fits=False, why_not=why, over_bound=why)


def predict_colocated(
    profile: Profile, context: int, batch: int, tp: int = 1
) -> Prediction:
    """Plain vLLM: one device per replica (``tp`` 1), or tensor parallel over
    ``tp`` devices (measured: ``profile.colocated_tp``)."""
    curves = profile.colocated if tp == 1 else profile.colocated_tp[tp]
    step = _nearest(curves, context)(batch)
    devices = 1 if profile.shared_cores else tp
    name = "colocated" if tp == 1 else f"colocated TP{tp}"
    per_device = batch / step / devices
    return Prediction(name, context, batch, step, step, 0.0, 0.0, per_device)


def equal_batch(profile: Profile, cand: Candidate, batch: int) -> int:
    """The sequences per device ``cand`` holds at ``batch`` per attention
    rank: every rank's on a shared device, else spread over its devices."""
    total = cand.attention_ranks * batch
    if profile.shared_cores:
        return total
    return max(1, round(total / cand.devices))


def at_equal_batch(profile: Profile, p: Prediction) -> Prediction | None:
    """Plain vLLM (one device) holding as many sequences per device as the
    deployment of ``p`` (:func:`equal_batch`); None for a baseline or where
    plain vLLM was not measured at ``p``'s context."""
    if p.candidate is None or not profile.colocated:
        return None
    return predict_colocated(
        profile, p.context, equal_batch(profile, p.candidate, p.batch)
    )


def colocated_batches(
    profile: Profile, context: int, batches: Sequence[int]
) -> list[int]:
    """The batches the colocated baseline chooses from: ``batches`` and every
    batch plain vLLM was measured at (on a shared device also those its
    deployments hold, ``k*b``)."""
    measured = _nearest(profile.colocated, context).points if profile.colocated else ()
    return sorted({*batches, *(int(x) for x, _ in measured)})


def colocated_tps(profile: Profile, devices: int) -> list[int]:
    """The tensor-parallel sizes of the colocated baselines that fit
    ``devices`` (1: data-parallel replicas of one device each)."""
    return [1, *sorted(n for n in profile.colocated_tp if n <= devices)]


def _fits(
    p: Prediction, kv_tokens: int | None, context: int, decode: int, slo_s: float | None
) -> Prediction:
    need = p.batch * (context + decode)
    if kv_tokens is not None and need > kv_tokens:
        why = f"KV: {p.batch} x {context + decode} tokens > {kv_tokens}"
    elif slo_s is not None and p.step_s > slo_s:
        why = f"TPOT {p.step_s * 1e3:.1f} ms > SLO {slo_s * 1e3:.1f} ms"
    else:
        return p
    return dataclasses.replace(p, fits=False, why_not=why)


def candidates(devices: int, max_ubatches: int = 2) -> list[Candidate]:
    """Every xAyF (x >= y >= 1, x + y <= devices) and m in 1..max_ubatches."""
    return [
        Candidate(x, y, m)
        for total in range(2, devices + 1)
        for y in range(1, total // 2 + 1)
        for x in [total - y]
        for m in range(1, max_ubatches + 1)
    ]


@dataclass(frozen=True)
class Choice:
    """The best batch of one deployment at one context (None: nothing fits)."""

    best: Prediction | None
    tried: tuple[Prediction, ...]


def best_batch(
    profile: Profile,
    cand: Candidate | None,
    context: int,
    batches: Sequence[int],
    slo_s: float | None,
    tp: int = 1,
) -> Choice:
    """The batch (of ``batches``) with the most tokens/s per device that fits
    the KV capacity and the SLO; ``cand`` None is the colocated baseline of
    tensor-parallel size ``tp``."""
    if cand is not None:
        kv = profile.kv_tokens_attention
    elif tp == 1:
        kv = profile.kv_tokens_colocated
    else:
        kv = profile.kv_tokens_colocated_tp.get(tp)
    tried = []
    for b in batches:
        if cand is None:
            p = predict_colocated(profile, context, b, tp)
        else:
            p = bounded(profile, predict(profile, cand, context, b))
        if p.fits:
            p = _fits(p, kv, context, profile.decode_tokens, slo_s)
        tried.append(p)
    fitting = [p for p in tried if p.fits]
    best = max(fitting, key=lambda p: p.tokens_per_s_per_device, default=None)
    return Choice(best, tuple(tried))


REASONS = {
    Bound.ATTENTION: "attention-bound: the attention ranks' work is the largest "
    "part of its step, the FFN rank waits for them",
    Bound.COMMUNICATION: "communication-bound: the round trip (on shared cores "
    "with what sharing them costs) is the largest part of its step",
    Bound.FFN: "FFN-bound: the FFN rank's compute is the largest part of its "
    "step, the attention ranks wait for it",
}


@dataclass(frozen=True)
class Plan:
    """Every deployment's best batch per context, the baseline, the pick."""

    contexts: tuple[int, ...]
    rows: tuple[Prediction, ...]  # best per (deployment, context); fits only
    baselines: dict[int, Prediction | None]
    recommended: Prediction | None
    reason: str
    unfit: tuple[Prediction, ...] = field(default=())
    #: predictions that broke the device bound (never recommended)
    over_bound: tuple[Prediction, ...] = field(default=())
    #: per row of ``rows``: plain vLLM holding as many sequences per device
    #: (:func:`at_equal_batch`; None where not known)
    equal: tuple[Prediction | None, ...] = field(default=())

    def to_json(self) -> dict:
        return {
            "contexts": list(self.contexts),
            "rows": [p.to_json() for p in self.rows],
            "equal_batch": [p.to_json() if p else None for p in self.equal],
            "over_bound": [p.to_json() for p in self.over_bound],
            "baselines": {
                str(c): p.to_json() if p else None for c, p in self.baselines.items()
            },
            "recommended": self.recommended.to_json() if self.recommended else None,
            "reason": self.reason,
            "unfit": [p.to_json() for p in self.unfit],
        }


def make_plan(
    profile: Profile,
    devices: int,
    contexts: Sequence[int],
    batches: Sequence[int],
    slo_s: float | None,
    max_ubatches: int = 2,
) -> Plan:
    """Predict every deployment that fits ``devices``; recommend the one with
    the most tokens/s per device, averaged over ``contexts``."""
    rows, unfit, over = [], [], []
    score: dict[str, list[Prediction]] = {}  # per deployment, its best per context
    if profile.shared_cores and not profile.ubatching:
        max_ubatches = 1  # U not measured: no micro-batches to predict
    for cand in candidates(devices, max_ubatches):
        for c in contexts:
            choice = best_batch(profile, cand, c, batches, slo_s)
            over += [p for p in choice.tried if p.over_bound]
            if choice.best is None:
                unfit.append(choice.tried[0])
                continue
            rows.append(choice.best)
            score.setdefault(cand.name, []).append(choice.best)
    baselines = {
        c: _best(
            best_batch(
                profile, None, c,
                colocated_batches(profile, c, batches) if tp == 1 else batches,
                slo_s, tp,
            ).best
            for tp in colocated_tps(profile, devices)
        )
        for c in contexts
    }  # fmt: skip
    equal = tuple(at_equal_batch(profile, p) for p in rows)
    full = {k: v for k, v in score.items() if len(v) == len(contexts)}
    if not full:
        return Plan(tuple(contexts), tuple(rows), baselines, None,
                    "no deployment fits the device budget, KV capacity, SLO "
                    "and device bound", tuple(unfit), tuple(over), equal)  # fmt: skip
    pick = max(full, key=lambda k: _mean(p.tokens_per_s_per_device for p in full[k]))
    best = max(full[pick], key=lambda p: p.tokens_per_s_per_device)
    assert best.bound is not None  # predict() bounds every deployment
    reason = REASONS[best.bound]
    base = [p.tokens_per_s_per_device for p in baselines.values() if p]
    if base:
        ratio = _mean(p.tokens_per_s_per_device for p in full[pick]) / _mean(base)
        reason += f"; {ratio:.2f}x colocated per device at its best batch"
        same = equal[rows.index(best)]
        if same is not None:
            reason += (
                f", {best.tokens_per_s_per_device / same.tokens_per_s_per_device:.2f}x"
                f" plain vLLM holding as many sequences ({same.batch}) per device"
            )
        if ratio < 1:
            reason += "; plain vLLM serves more per device here"
    return Plan(
        tuple(contexts), tuple(rows), baselines, best, reason, tuple(unfit),
        tuple(over), equal,
    )  # fmt: skip


def _best(predictions: Iterable[Prediction | None]) -> Prediction | None:
    """The prediction with the most tokens/s per device (None: none fits)."""
    fitting = [p for p in predictions if p is not None]
    return max(fitting, key=lambda p: p.tokens_per_s_per_device, default=None)


def _mean(values: Iterable[float]) -> float:
    v = list(values)
    return sum(v) / len(v) if v else 0.0
