"""The attention role's side of the per-layer exchange.

The attention model holds a parameter-free proxy at each remote MLP/MoE
position; the proxy calls ``torch.ops.vllm_afd.ffn_exchange(hidden, layer_idx)``,
an opaque custom op (so ``torch.compile`` never traces the transfer), which
lands in the process's :class:`AttentionExchange`::

    forward(input_ids, positions)          <- begin_step(T, mode): the StepPlan
      layer i: attention ... proxy(hidden) <- exchange(hidden [T, H], i)
                                              A2F send, F2A receive

CUDA graphs: the plan always travels outside any captured region. A forward
whose graphs are being recorded (FULL, or vLLM's piecewise graphs, which hold
the exchanges like every other op between two attention layers) sends a
CAPTURE plan before the decoder stack runs; a forward that replays piecewise
graphs sends a REPLAY plan. A FULL graph replay never runs the forward, so
the runner sends its REPLAY plan just before it replays
(``worker.attention_side.announce_graphs``). The exchange joins the
connector's stream back before returning (always, on CUDA), so a graph holds
the whole NCCL send and receive and no send is left pending into the next
step.

With attention tensor parallelism only TP rank 0 is a connector endpoint; it
exchanges and broadcasts the F2A result to the other TP ranks, so a TP group
never ships duplicate activations.

Losing the FFN rank (``worker.ffn_link``): a connector error never leaves the
forward. The exchange records it in :attr:`AttentionExchange.failure`, tells
the link, and serves this and every later layer zeros without exchanging, so
the forward (and every TP and DP collective in it) runs to its end; the runner
then fails the step's requests. While the link is down, steps do the same from
their first layer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import torch

from vllm_afd.connector.payloads import RecvHandle, Routing, SendHandle
from vllm_afd.connector.protocol import ExecMode, StepPlan
from vllm_afd.errors import AFDConnectorError, AFDError


class ExchangeConnector(Protocol):
    """What the exchange needs of an attention connector (the facade,
    ``connector.AFDConnector``)."""

    def send_plan(self, plan: StepPlan) -> None: ...

    def send_a2f(
        self,
        layer_idx: int,
        ubatch_idx: int,
        hidden: torch.Tensor,
        routing: Routing | None = None,
    ) -> SendHandle: ...

    def irecv_f2a(
        self, layer_idx: int, ubatch_idx: int, out: torch.Tensor | None = None
    ) -> RecvHandle: ...


C = TypeVar("C", bound=ExchangeConnector)
C_co = TypeVar("C_co", bound=ExchangeConnector, covariant=True)


class ExchangeLink(Protocol[C_co]):
    """What the exchange needs of an FFN link (``worker.ffn_link.FFNLink``)."""

    @property
    def connector(self) -> C_co | None: ...

    def begin_step(self) -> None: ...

    def unavailable_because(self) -> str: ...

    def lost(self, why: str) -> None: ...


class MicroBatchSwitch(Protocol):
    """What the exchange needs of a micro-batch switch
    (``worker.ubatching.UBatchSwitch``)."""

    def active(self) -> bool: ...

    def index(self) -> int: ...

    def yield_(self) -> None: ...


class AttentionExchange(Generic[C]):
    """Per-process state: the connector, the step counter, the TP group
    (vLLM's ``GroupCoordinator``; None without attention tensor parallelism)."""

    def __init__(
        self,
        connector: C | None,
        tp_group: Any | None = None,
        on_step: Callable[[StepPlan], None] | None = None,
        switch: MicroBatchSwitch | None = None,
        link: ExchangeLink[C] | None = None,
    ) -> None:
        # The connector of the current step (the link's, when there is one).
        self.connector = connector if link is None else link.connector
        self.link = link
        # This process exchanges (TP rank 0); the others receive broadcasts.
        self.is_endpoint = self.connector is not None
        # Why the current step ran without its FFN rank (None: it did not).
        self.failure: str | None = None
        self.tp_group = tp_group
        self.on_step = on_step
        # Micro-batches (``worker.ubatching``): which one runs, and hand-off.
        self.switch = switch
        self.step_id = 0
        # steps of two or more micro-batches (afd_attention_ubatched_steps)
        self.ubatched_steps = 0
        # True while the runner records CUDA graphs (announce_graphs).
        self.capturing_graphs = False
        self._staged: tuple[int, ...] | None = None
        self._lock = threading.Lock()

    def begin_step(
        self, tokens: int | Sequence[int], mode: ExecMode = ExecMode.EAGER
    ) -> None:
        """Send a step's plan: its tokens, or tokens per micro-batch."""
        ubatch_tokens = (tokens,) if isinstance(tokens, int) else tuple(tokens)
        with self._lock:
            self.step_id += 1
            self.ubatched_steps += len(ubatch_tokens) > 1
            plan = StepPlan(self.step_id, mode, ubatch_tokens)
            if self.on_step is not None:
                self.on_step(plan)
            if self.link is not None:
                self.link.begin_step()
                self.connector = self.link.connector
                if self.connector is None and self.failure is None:
                    self.failure = self.link.unavailable_because()
            if self.connector is not None:
                try:
                    self.connector.send_plan(plan)
                except AFDError as e:
                    self._lost(e)

    def _lost(self, error: AFDError) -> None:
        """A connector call failed: without a link, raise it; with one, note
        it, tell the link, and exchange nothing more this step."""
        if self.link is None:
            raise error
        if self.failure is None:
            self.failure = str(error)
        self.connector = None
        self.link.lost(str(error))

    def stage_ubatches(self, ubatch_tokens: tuple[int, ...]) -> None:
        """The runner split the next step: tokens per micro-batch."""
        self._staged = ubatch_tokens

    def begin_forward(self, num_tokens: int, mode: ExecMode) -> None:
        """Called by the model's forward before the decoder stack runs.

        In a micro-batched step every micro-batch runs the forward on its
        slice; the first one announces the whole step with the staged split.
        """
        switch = self.switch
        if switch is None or not switch.active():
            self.begin_step(num_tokens, mode)
            return
        if switch.index() != 0:
            return
        staged, self._staged = self._staged, None
        if staged is None or staged[0] != num_tokens:
            raise AFDConnectorError(
                f"micro-batch 0 runs {num_tokens} tokens but the runner staged "
                f"{staged}; the micro-batch runner must stage every split"
            )
        self.begin_step(staged, mode)

    def exchange(
        self,
        hidden: torch.Tensor,
        layer_idx: int,
        routing: Routing | None = None,
        parts: int = 1,
    ) -> torch.Tensor:
        """Ship ``hidden [T, H]`` (and routing) for ``layer_idx``; return the
        FFN output ``[T, parts * H]``."""
        # The op returns storage of its own: a compiled graph may still read
        # this layer's output after the next exchange, and under CUDA graph
        # capture the receive lands in the graph's memory pool.
        out = _output_like(hidden, parts)
        if self.is_endpoint:
            switch = self.switch
            if switch is not None and not switch.active():
                switch = None  # this forward runs no micro-batches
            ubatch = switch.index() if switch is not None else 0
            sent: SendHandle | None = None
            received: RecvHandle | None = None
            if self.connector is not None:
                try:
                    sent = self.connector.send_a2f(
                        layer_idx, ubatch, hidden.contiguous(), routing
                    )
                    received = self.connector.irecv_f2a(layer_idx, ubatch, out=out)
                except AFDError as e:
                    self._lost(e)
            if switch is not None:
                # The next micro-batch computes while this one is away. The
                # transfers are issued in the order the FFN serves them, layer
                # by layer and micro-batch by micro-batch.
                switch.yield_()
            if received is not None and self.connector is not None:
                try:
                    received.wait()
                    if hidden.is_cuda and sent is not None:  # set with received
                        # Join the send's stream back now (a stream wait, no
                        # host wait; the receive completes after the send
                        # anyway): a send left pending would be joined at the
                        # next step boundary, which may sit inside a graph
                        # capture that must not depend on uncaptured work. CPU
                        # sends are waited at that boundary.
                        sent.wait()
                except AFDError as e:
                    self._lost(e)
            if self.failure is not None:
                out.zero_()  # finite: the step's tokens are thrown away
        if self.tp_group is not None and self.tp_group.world_size > 1:
            out = self.tp_group.broadcast(out, src=0)
        return out


def forward_mode(positions: torch.Tensor) -> ExecMode:
    """How the FFN must serve the forward that is starting.

    CAPTURE when CUDA graphs are being recorded around the exchanges: a FULL
    graph (the stream is capturing now), or the piecewise graphs vLLM records
    inside this forward. REPLAY when this forward replays piecewise graphs,
    which hold the exchanges as they hold every op between two attention
    layers (a FULL replay never runs the forward; the runner announces it).
    WARMUP for profile, compile and idle (dummy) forwards, which carry no
    attention metadata and may compile on the way, so the FFN waits longer,
    and for the eager warm-up runs the runner makes while it records graphs
    (dummy batches too; a profiler waiting for served steps skips them).
    EAGER otherwise.
    """
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context

    if positions.is_cuda and torch.cuda.is_current_stream_capturing():
        return ExecMode.CAPTURE
    context = get_forward_context()
    if context.cudagraph_runtime_mode == CUDAGraphMode.PIECEWISE:
        capturing = current_exchange().capturing_graphs
        return ExecMode.CAPTURE if capturing else ExecMode.REPLAY
    if context.attn_metadata is None or current_exchange().capturing_graphs:
        return ExecMode.WARMUP
    return ExecMode.EAGER


_current: AttentionExchange[Any] | None = None


def install_exchange(exchange: AttentionExchange[Any] | None) -> None:
    """Make ``exchange`` the process's exchange (None removes it)."""
    global _current
    _current = exchange


def current_exchange() -> AttentionExchange[Any]:
    if _current is None:
        raise AFDConnectorError(
            "the AFD attention model ran without a connector: before the "
            "attention worker started it in load_model, or after it closed"
        )
    return _current


def _ffn_exchange(hidden: torch.Tensor, layer_idx: int, parts: int = 1) -> torch.Tensor:
    return current_exchange().exchange(hidden, layer_idx, parts=parts)


def _output_like(hidden: torch.Tensor, parts: int) -> torch.Tensor:
    """An uninitialised exchange output for ``hidden [T, H]``: ``[T, parts * H]``."""
    return hidden.new_empty((hidden.shape[0], hidden.shape[1] * parts))


def _ffn_exchange_fake(
    hidden: torch.Tensor, layer_idx: int, parts: int = 1
) -> torch.Tensor:
    return _output_like(hidden, parts)


def _ffn_exchange_routed(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    layer_idx: int,
    parts: int = 1,
) -> torch.Tensor:
    routing = Routing(
        topk_weights=topk_weights.to(torch.float32).contiguous(),
        topk_ids=topk_ids.to(torch.int32).contiguous(),
    )
    return current_exchange().exchange(hidden, layer_idx, routing, parts)


def _ffn_exchange_routed_fake(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    layer_idx: int,
    parts: int = 1,
) -> torch.Tensor:
    return _output_like(hidden, parts)


def _ffn_exchange_routed_out(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    layer_idx: int,
    parts: int = 1,
) -> None:
    out.copy_(_ffn_exchange_routed(hidden, topk_weights, topk_ids, layer_idx, parts))


def _fills_out(*args: Any, **kwargs: Any) -> None:
    """The fake of an op that writes into its ``out`` argument only."""
    return None


_lib = torch.library.Library("vllm_afd", "FRAGMENT")


def _register(schema: str, impl: Callable[..., Any], fake: Callable[..., Any]) -> None:
    """Define ``vllm_afd::<schema>`` with ``impl`` on CPU and CUDA."""
    name = schema.split("(", 1)[0]
    _lib.define(schema)
    for device in ("CPU", "CUDA"):
        _lib.impl(name, impl, device)
    torch.library.register_fake(f"vllm_afd::{name}", fake, lib=_lib)


_register(
    "ffn_exchange(Tensor hidden, int layer_idx, int parts=1) -> Tensor",
    _ffn_exchange,
    _ffn_exchange_fake,
)
_register(
    "ffn_exchange_routed(Tensor hidden, Tensor topk_weights, Tensor topk_ids, "
    "int layer_idx, int parts=1) -> Tensor",
    _ffn_exchange_routed,
    _ffn_exchange_routed_fake,
)
_register(
    "ffn_exchange_routed_out(Tensor hidden, Tensor topk_weights, Tensor topk_ids, "
    "Tensor(a!) out, int layer_idx, int parts=1) -> ()",
    _ffn_exchange_routed_out,
    _fills_out,
)

#: The op vLLM's piecewise CUDA graphs split at on the ``async`` connector:
#: it runs between two graphs, eagerly, and writes into a tensor the graph
#: before it allocated, whose address every replay keeps (as vLLM's own
#: attention op does).
SPLITTING_OP = "vllm_afd::ffn_exchange_routed_out"


def ffn_exchange(hidden: torch.Tensor, layer_idx: int, parts: int = 1) -> torch.Tensor:
    """The custom op the attention-side proxies call: ``[T, parts * H]``."""
    return torch.ops.vllm_afd.ffn_exchange(hidden, layer_idx, parts)


def ffn_exchange_routed(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    layer_idx: int,
    parts: int = 1,
) -> torch.Tensor:
    """The custom op of MoE proxies that route on attention."""
    return torch.ops.vllm_afd.ffn_exchange_routed(
        hidden, topk_weights, topk_ids, layer_idx, parts
    )


def ffn_exchange_routed_out(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    layer_idx: int,
    parts: int = 1,
) -> torch.Tensor:
    """:func:`ffn_exchange_routed` as :data:`SPLITTING_OP`: the output is
    allocated here, in the caller's graph, and the op fills it."""
    out = _output_like(hidden, parts)
    torch.ops.vllm_afd.ffn_exchange_routed_out(
        hidden, topk_weights, topk_ids, out, layer_idx, parts
    )
    return out
