"""The attention role's side of the ``async`` connector.

The model's MoE proxies call the same custom op as with the synchronous
connector (``exchange.ffn_exchange_routed``: the gate runs here); this
exchange answers it without step plans::

    forward(input_ids, positions)      <- begin_step: counts the step, sends nothing
      layer i: attention ... MoE proxy <- exchange(hidden [T, H], i, routing):
                                          a work item to each FFN rank owning
                                          experts of these rows, their replies
                                          added (``connector.async_ep``)

With ``afd.num_ubatches = 2`` (CPU) a step may run as two stages on
threads of their own (``worker.stages``): a stage sends its work items,
hands the baton to the other stage, and reads its replies once the baton is
back, so one stage's attention overlaps the other's experts.

On a GPU the endpoint groups the rows there and writes each FFN rank's
work item into host memory (``payload: socket`` or ``shared``) or into
that rank's GPU slot (``cuda_ipc``), and adds the replies on the GPU. The
headers travel over TCP either way, so the exchange itself cannot be
captured in a CUDA graph: with piecewise graphs it is a splitting op
(``exchange.SPLITTING_OP``), run eagerly between two graphs and writing
into a tensor the graph before it allocated; the config refuses FULL graphs,
and an exchange met inside a capture raises. In the forward that records the
piecewise graphs (``ExecMode.CAPTURE``) the graph before the op was recorded,
not run, so its output is stale memory: the op sends nothing and returns
zeros there.

Losing an FFN rank (it exited, shut down, or did not answer in
``timeout_s``) is the synchronous connector's story (``worker.ffn_link``):
the exchange records the failure, tells the link, and serves this and every
later layer zeros without exchanging; the runner then fails the step's
requests, and while the link is down (503 naming the FFN rank) steps do the
same. The link closes the endpoint telling every FFN rank to rendezvous
again, and opens a new one once the lost rank is back (restarted by its
launcher): the whole session re-forms, since its experts are nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from vllm_afd.connector.async_ep import AsyncAttention
from vllm_afd.connector.payloads import Routing
from vllm_afd.connector.protocol import ExecMode, StepPlan
from vllm_afd.errors import AFDConfigError, AFDConnectorError, AFDError
from vllm_afd.models.exchange import SPLITTING_OP, AttentionExchange

#: the modes of a step that serves requests (not a warm-up or a capture)
_SERVED = (ExecMode.EAGER, ExecMode.REPLAY)


class AsyncLink(Protocol):
    """What the exchange needs of an FFN link over an async endpoint
    (``worker.ffn_link.FFNLink[AsyncAttention]``)."""

    @property
    def connector(self) -> AsyncAttention | None: ...

    def unavailable_because(self) -> str: ...

    def lost(self, why: str, ffn_rank: int | None = None) -> None: ...


class AsyncAttentionExchange(AttentionExchange[Any]):
    """Per-process state of an attention rank on the ``async`` connector.

    Args:
        endpoint: the started endpoint (None on TP ranks other than 0,
            which the config refuses for ``async``).
        shared_experts: the model's MoE layers have shared experts (they run
            on FFN rank 0, which then gets every row).
        on_step: called with each step's record (the profiler).
    """

    def __init__(
        self,
        endpoint: AsyncAttention | None,
        shared_experts: bool,
        on_step: Callable[[StepPlan], None] | None = None,
        link: AsyncLink | None = None,
    ) -> None:
        super().__init__(None, on_step=on_step)
        self.endpoint = endpoint if link is None else link.connector
        self.async_link = link
        self.is_endpoint = endpoint is not None
        self.shared_experts = shared_experts
        self._mode = ExecMode.WARMUP
        # A served step (EAGER, or a piecewise graph REPLAY) finished its
        # exchanges: from then on an exchange waits timeout_s (before:
        # warmup_timeout_s, as the FFN may compile shapes it meets first).
        self._served = False

    def begin_step(
        self, tokens: int | Sequence[int], mode: ExecMode = ExecMode.EAGER
    ) -> None:
        """Count the step: the async exchange sends no plan."""
        ubatch_tokens = (tokens,) if isinstance(tokens, int) else tuple(tokens)
        with self._lock:
            if self._mode in _SERVED and self.step_id > 0:
                self._served = True
            self.step_id += 1
            self.ubatched_steps += len(ubatch_tokens) > 1
            self._mode = mode
            if self.on_step is not None:
                self.on_step(StepPlan(self.step_id, mode, ubatch_tokens))
            link = self.async_link
            if link is not None:
                self.endpoint = link.connector
                if self.endpoint is None and self.failure is None:
                    self.failure = link.unavailable_because()
            if self.endpoint is not None:
                self.endpoint.note_step()

    def exchange(
        self,
        hidden: torch.Tensor,
        layer_idx: int,
        routing: Routing | None = None,
        parts: int = 1,
    ) -> torch.Tensor:
        if routing is None:
            raise AFDConnectorError(
                f"layer {layer_idx}: the async connector exchanges MoE layers "
                "routed on attention only (dense layers stay on attention)"
            )
        if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
            raise AFDConfigError(
                f"layer {layer_idx}: the async connector's exchange ran inside "
                "a CUDA graph capture, which cannot hold its work items' "
                "headers (sent from the host). It runs between piecewise "
                f"graphs ({SPLITTING_OP} among vLLM's splitting_ops, which AFD "
                "adds with cudagraph_mode PIECEWISE and compilation mode "
                "VLLM_COMPILE), or eagerly (--enforce-eager)"
            )
        if self._mode is ExecMode.CAPTURE:
            # vLLM records the piecewise graphs around this op in this
            # forward, and a graph being recorded does not run: the rows and
            # the routing this op gets are whatever that memory held (ids out
            # of range, NaN rows). Nothing is sent; every replay runs the op.
            return hidden.new_zeros(hidden.shape[0], parts * hidden.shape[1])
        endpoint = self.endpoint
        if endpoint is None or self.failure is not None:
            assert self.async_link is not None  # without a link it raised
            return _away(hidden, parts)
        slow = self._mode not in _SERVED or not self._served
        timeout_s = endpoint.warmup_timeout_s if slow else endpoint.timeout_s
        switch = self.switch
        if switch is not None and not switch.active():
            switch = None  # this forward runs whole
        try:
            # on hidden's device: the endpoint moves only what crosses to each
            # FFN rank (through host memory, or into its GPU slot)
            pending = endpoint.dispatch(
                layer_idx, hidden, routing.to(hidden.device), parts,
                self.shared_experts, timeout_s,
            )  # fmt: skip
            if switch is not None:
                # the other stage's attention runs while these rows are away
                try:
                    switch.yield_()
                except BaseException:
                    endpoint.abandon(pending)
                    raise
                if self.failure is not None:  # the other stage lost an FFN rank
                    endpoint.abandon(pending)
                    return _away(hidden, parts)
            out = endpoint.finish(pending, timeout_s)
        except AFDError as e:
            link = self.async_link
            if link is None:
                raise
            if self.failure is None:
                self.failure = str(e)
            self.endpoint = None
            link.lost(str(e), endpoint.lost_rank)
            return _away(hidden, parts)
        return out


def _away(hidden: torch.Tensor, parts: int) -> torch.Tensor:
    """The output of an exchange without its FFN ranks: finite zeros (the
    step's tokens are thrown away, the runner fails its requests)."""
    return hidden.new_zeros(hidden.shape[0], parts * hidden.shape[1])
