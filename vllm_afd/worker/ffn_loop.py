"""The FFN role's daemon loop: receive a plan, run the layers, send back.

Plain code over the connector facade, testable with the in-process
``loopback`` connector and no vLLM::

    while plan := connector.recv_plan():         # None: peers shut down
        for layer in remote_layers:
            for ubatch in range(plan.num_ubatches):
                batch = connector.recv_a2f(layer, ubatch)
                out = compute(layer, batch)        # dense MLP or MoE, merged
                connector.send_f2a(layer, ubatch, out)

It runs on a thread started by the FFN worker once the model is loaded. An
error ends the loop; it is kept in :attr:`FFNLoop.error`, logged, and handed
to ``on_exit`` so the worker can surface it.

CUDA graphs follow the plan's mode. CAPTURE: the attention role is recording
a graph of this step, so the loop records its own (every layer's receive,
compute and send) keyed by the step's token layout, and runs nothing. REPLAY:
the loop replays the graph of that layout, or serves the step eagerly when it
has none (NCCL matches a graph's transfers with eager ones). EAGER and
WARMUP: eager.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from vllm_afd.connector.payloads import A2FBatch
from vllm_afd.connector.plan import MergedPlan
from vllm_afd.connector.protocol import ExecMode
from vllm_afd.errors import AFDConnectorError, AFDPeerStopped
from vllm_afd.worker.compute_clock import ComputeClock, HostClock
from vllm_afd.worker.stall_watch import StallWatch

logger = logging.getLogger(__name__)

#: compute(layer_idx, batch) -> output [ΣT, parts * H]
ComputeFn = Callable[[int, A2FBatch], torch.Tensor]


class FFNConnector(Protocol):
    """What the loop needs from its connector (the facade's FFN side, or the
    TP relay in front of it)."""

    def recv_plan(self) -> MergedPlan | None:
        """The next merged step plan; None once every peer shut down."""
        ...

    def recv_a2f(self, layer_idx: int, ubatch_idx: int) -> A2FBatch:
        """This layer's merged activations (blocks up to the timeout)."""
        ...

    def send_f2a(self, layer_idx: int, ubatch_idx: int, out: torch.Tensor) -> Any:
        """Start returning ``out [ΣT, C]``, each peer its slice."""
        ...

    def flush(self) -> None:
        """Wait for every send still in flight."""
        ...

    def account_graph_step(self) -> None:
        """Count a step served by a graph replay in the traffic counters."""
        ...

    def close(self) -> None:
        """Tell the peers and release the transport (unblocks the loop)."""
        ...


class StepGraphs(Protocol):
    """Graphs of whole FFN steps, keyed by the merged plan's token layout."""

    def capture(self, plan: Any, serve: Callable[[], None]) -> None:
        """Record ``serve()`` (one step's exchanges and compute) for ``plan``."""

    def replay(self, plan: Any) -> bool:
        """Replay the graph of ``plan``'s layout; False when there is none."""


@dataclass
class FFNLoopStats:
    """Counters kept by the loop (read by metrics; plain numbers).

    ``in_step`` is held while a step (a work item on ``async``) is being
    served: the connector's byte counters move inside it and ``tokens`` at
    its end, so a reader that holds it sees both at the same step boundary.
    """

    steps: int = 0
    tokens: int = 0
    last_batch_tokens: int = 0
    graph_captures: int = 0
    graph_replays: int = 0
    ubatched_steps: int = 0
    in_step: threading.Lock = field(
        default_factory=threading.Lock, repr=False, compare=False
    )
    #: times the layers' compute (device time on CUDA; replayed graphs not)
    clock: ComputeClock = field(default_factory=HostClock, repr=False, compare=False)

    @property
    def compute_s(self) -> float:
        """Seconds of FFN compute finished so far (:attr:`clock`)."""
        return self.clock.seconds()


_WAITING = "waiting for the attention ranks' rows"


def describe_plan(plan: Any) -> str:
    """A merged step in the words of the stall log."""
    return f"step {plan.step_id} ({plan.mode.name}, {plan.num_tokens} tokens)"


class FFNLoop:
    """Drives one FFN endpoint until its peers shut down or it is stopped."""

    def __init__(
        self,
        connector: FFNConnector,
        compute: ComputeFn,
        remote_layers: Sequence[int],
        *,
        on_exit: Callable[[BaseException | None], None] | None = None,
        on_step: Callable[[Any], None] | None = None,
        graphs: StepGraphs | None = None,
        clock: ComputeClock | None = None,
        watch: StallWatch | None = None,
    ) -> None:
        """``watch``: told the phases of each step, so that one of the FFN's
        own work that stalls is logged with the serving thread's stack
        (:mod:`vllm_afd.worker.stall_watch`, steps in the words of
        :func:`describe_plan`); None: not watched."""
        self.connector = connector
        self.graphs = graphs
        self.compute = compute
        self.remote_layers = tuple(remote_layers)
        self.on_exit = on_exit
        self.on_step = on_step
        self.stats = FFNLoopStats(clock=clock or HostClock())
        self.error: BaseException | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.watch = watch

    def run_step(self, plan: Any) -> None:
        """Serve one merged plan: eagerly, or by capturing or replaying a graph."""
        with self.stats.in_step:
            self._run_step(plan)

    def _run_step(self, plan: Any) -> None:
        if self.on_step is not None:
            self.on_step(plan)
        watch = self.watch
        if plan.mode is ExecMode.CAPTURE:
            if self.graphs is None:
                raise AFDConnectorError(
                    f"step {plan.step_id}: the attention role captures a CUDA "
                    "graph, but this FFN rank cannot capture graphs on its device"
                )
            if watch is not None:
                watch.phase(plan, "capturing its graph")
            self.graphs.capture(plan, lambda: self._serve_and_flush(plan))
            self.stats.graph_captures += 1
        elif plan.mode is ExecMode.REPLAY and self._replayed(plan):
            self.connector.account_graph_step()
            self.stats.graph_replays += 1
        else:
            self._serve(plan)
        if watch is not None:
            watch.idle()
        self.stats.steps += 1
        self.stats.ubatched_steps += plan.num_ubatches > 1
        self.stats.tokens += plan.num_tokens
        self.stats.last_batch_tokens = plan.num_tokens

    def _replayed(self, plan: Any) -> bool:
        """Replay the graph of ``plan``'s layout; False when there is none."""
        if self.graphs is None:
            return False
        if self.watch is not None:
            self.watch.phase(plan, "replaying its graph")
        return self.graphs.replay(plan)

    def _serve_and_flush(self, plan: Any) -> None:
        self._serve(plan)
        if self.watch is not None:  # what is left is the capture's own
            self.watch.phase(plan, "capturing its graph")
        self.connector.flush()

    def _serve(self, plan: Any) -> None:
        """Every remote layer and ubatch of ``plan``, the compute timed."""
        clock, watch = self.stats.clock, self.watch
        for layer_idx in self.remote_layers:
            for ubatch_idx in range(plan.num_ubatches):
                if plan.ubatch_tokens[ubatch_idx] == 0:
                    continue
                if watch is not None:
                    watch.phase(plan, _WAITING, layer_idx, waiting=True)
                batch = self.connector.recv_a2f(layer_idx, ubatch_idx)
                if watch is not None:
                    watch.phase(plan, "computing", layer_idx)
                with clock.span():
                    out = self.compute(layer_idx, batch)
                if watch is not None:
                    watch.phase(plan, "replying", layer_idx)
                self.connector.send_f2a(layer_idx, ubatch_idx, out)

    def run(self) -> None:
        """Loop until the peers shut down, :meth:`stop` is called, or an error."""
        error: BaseException | None = None
        if self.watch is not None:
            self.watch.start()
        try:
            while not self._stopping.is_set():
                plan = self.connector.recv_plan()
                if plan is None:
                    logger.info("AFD FFN loop: attention peers shut down")
                    break
                self.run_step(plan)
        except AFDPeerStopped as exc:
            # a stop that came inside a step ends the loop as one between steps
            logger.info("AFD FFN loop: attention peers shut down (%s)", exc)
        except BaseException as exc:  # kept, logged and handed to on_exit
            if not self._stopping.is_set():
                error = exc
                self.error = exc
                # a connector error says what and where; anything else is a bug
                trace = None if isinstance(exc, AFDConnectorError) else exc
                logger.error("AFD FFN loop failed: %s", exc, exc_info=trace)
        finally:
            if self.watch is not None:
                self.watch.stop()
            if self.on_exit is not None:
                self.on_exit(error)

    def start(self, name: str = "afd-ffn-loop") -> threading.Thread:
        self._thread = threading.Thread(target=self.run, name=name, daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop: close the connector (unblocks it) and join."""
        self._stopping.set()
        self.connector.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def stopping(self) -> bool:
        """:meth:`stop` was called (the worker shuts down)."""
        return self._stopping.is_set()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
