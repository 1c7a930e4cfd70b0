"""Live AFD counters, exported where vLLM exports its metrics.

The engine-config hook turns on Prometheus multiprocess mode in the API
server before the engine starts (as vLLM itself does for several API
servers), so counters written by a worker process appear on that server's
``/metrics``. A publisher thread copies the connector's and the FFN loop's
plain counters into Prometheus every ``interval`` seconds: nothing is added
to the per-layer hot path. On the FFN role it copies them between steps
(``FFNLoopStats.in_step``), so ``afd_f2a_bytes`` and ``afd_ffn_tokens`` always
describe the same steps; a tick that finds a step running longer than
``interval`` publishes nothing and the next one catches up.

Metric names (labels ``role``, ``rank``)::

    afd_steps_total                      forward steps exchanged
    afd_a2f_bytes_total                  A2F payload bytes
    afd_f2a_bytes_total                  F2A payload bytes
    afd_connector_wait_seconds_total     host time blocked in data-plane waits
    afd_ffn_compute_seconds_total        FFN compute time (FFN role; device
                                         time on CUDA, eager steps only)
    afd_ffn_tokens_total                 tokens computed (FFN role)
    afd_errors_total                     connector errors
    afd_ffn_graph_replays_total          steps replayed from CUDA graphs (FFN role)
    afd_ffn_ubatched_steps_total         steps of two or more micro-batches (FFN role)
    afd_attention_ubatched_steps_total   steps this attention rank split into two
                                         or more micro-batches (attention role)
    afd_ffn_losses_total                 times this attention rank lost its FFN rank
    afd_ffn_rejoins_total                times its FFN rank came back (rejoined)

On the attention role the connector counters add up over every connector the
rank had: one per rejoin (``worker.ffn_link``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from vllm_afd.connector.payloads import ConnectorStats
    from vllm_afd.worker.ffn_loop import FFNLoopStats

METRICS = {
    "steps": ("afd_steps", "AFD forward steps exchanged"),
    "a2f_bytes": ("afd_a2f_bytes", "AFD attention-to-FFN payload bytes"),
    "f2a_bytes": ("afd_f2a_bytes", "AFD FFN-to-attention payload bytes"),
    "wait_s": ("afd_connector_wait_seconds", "AFD connector wait time"),
    "compute_s": ("afd_ffn_compute_seconds", "AFD FFN compute time"),
    "tokens": ("afd_ffn_tokens", "AFD tokens computed by the FFN role"),
    "errors": ("afd_errors", "AFD connector errors"),
    "graph_replays": (
        "afd_ffn_graph_replays",
        "AFD steps the FFN role replayed from CUDA graphs",
    ),
    "ubatched_steps": (
        "afd_ffn_ubatched_steps",
        "AFD steps the FFN role served as two or more micro-batches",
    ),
    "attention_ubatched_steps": (
        "afd_attention_ubatched_steps",
        "AFD steps the attention rank split into two or more micro-batches",
    ),
    "losses": ("afd_ffn_losses", "AFD times this attention rank lost its FFN rank"),
    "rejoins": ("afd_ffn_rejoins", "AFD times the FFN rank rejoined this rank"),
}


def _prometheus_counters(role: str) -> dict[str, Any]:
    import prometheus_client
    from prometheus_client import values

    # A forked worker inherits the parent's value class, chosen before the
    # multiprocess directory was set; choose again.
    values.ValueClass = values.get_value_class()
    return {
        key: prometheus_client.Counter(name, doc, ["role", "rank"], registry=None)
        for key, (name, doc) in METRICS.items()
    }


class MetricsPublisher:
    """Copies ``snapshot()`` counters into Prometheus on a thread."""

    def __init__(
        self,
        role: str,
        rank: int,
        snapshot: Callable[[], dict[str, float] | None],
        interval: float = 0.5,
    ) -> None:
        self.labels = {"role": role, "rank": str(rank)}
        self.snapshot = snapshot
        self.interval = interval
        self.counters = _prometheus_counters(role)
        self._last: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="afd-metrics", daemon=True
        )

    def start(self) -> MetricsPublisher:
        self._thread.start()
        return self

    def publish(self) -> None:
        current = self.snapshot()
        if current is None:  # no consistent reading this tick
            return
        for key, value in current.items():
            delta = value - self._last.get(key, 0)
            if delta > 0 and key in self.counters:
                self.counters[key].labels(**self.labels).inc(delta)
        self._last = current

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.publish()

    def stop(self) -> None:
        self._stop.set()
        self.publish()


class StatsSource(Protocol):
    """What a publisher reads of a connector (``connector.AFDConnector``, or
    an attention rank's ``worker.ffn_link.FFNLink`` summing its connectors)."""

    @property
    def stats(self) -> ConnectorStats: ...


class CountingLoop(Protocol):
    """What a publisher reads of an FFN loop (``worker.ffn_loop.FFNLoop``,
    ``worker.async_loop.AsyncFFNLoop``)."""

    stats: FFNLoopStats


def endpoint_publisher(
    role: str,
    rank: int,
    connector: StatsSource,
    loop: CountingLoop | None = None,
    link: Any | None = None,
    interval: float = 0.5,
    ubatched_steps: Callable[[], int] | None = None,
) -> MetricsPublisher:
    """A started publisher for one endpoint's connector (anything with
    ``stats``: a connector, an FFN link), FFN loop and FFN link;
    ``ubatched_steps``: an attention rank's count of split steps."""

    def snapshot() -> dict[str, float] | None:
        if loop is None:
            return read()
        # between two steps, or not at all this tick
        if not loop.stats.in_step.acquire(timeout=interval):
            return None
        try:
            return read()
        finally:
            loop.stats.in_step.release()

    def read() -> dict[str, float]:
        stats = connector.stats
        values = {
            "steps": stats.steps,
            "a2f_bytes": stats.a2f_bytes,
            "f2a_bytes": stats.f2a_bytes,
            "wait_s": stats.wait_s,
            "errors": stats.errors,
        }
        if loop is not None:
            values["compute_s"] = loop.stats.compute_s
            values["tokens"] = loop.stats.tokens
            values["graph_replays"] = loop.stats.graph_replays
            values["ubatched_steps"] = loop.stats.ubatched_steps
        if ubatched_steps is not None:
            values["attention_ubatched_steps"] = ubatched_steps()
        if link is not None:
            values["losses"] = link.state.losses
            values["rejoins"] = link.state.rejoins
        return values

    return MetricsPublisher(role, rank, snapshot, interval).start()
