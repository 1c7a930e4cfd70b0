"""The FFN role's CUDA graphs: one per step layout the attention role captures.

When the attention role records CUDA graphs of a step (a FULL graph, or the
piecewise graphs that hold the exchanges), the FFN records the other half of
it: every remote layer's A2F receive, MLP/MoE and F2A send, as one graph
keyed by the merged plan's token layout (``peer_tokens``). A later REPLAY
plan with that layout replays it; the two sides' NCCL transfers meet on the
GPUs without either host taking part. The FFN's half does not depend on the
attention's graph mode, so a FULL and a piecewise capture of one layout share
a graph (the later capture replaces the earlier).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from vllm.logger import init_logger

logger = init_logger(__name__)


class CudaStepGraphs:
    """:class:`~vllm_afd.worker.ffn_loop.StepGraphs` on one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._graphs: dict[tuple[tuple[int, ...], ...], torch.cuda.CUDAGraph] = {}
        self._pool: Any = None
        self._stream: torch.cuda.Stream | None = None

    def capture(self, plan: Any, serve: Callable[[], None]) -> None:
        """Record ``serve`` as the graph of ``plan``'s layout.

        Not through ``torch.cuda.graph``, whose entry synchronises the device
        and empties the allocator's cache (``cudaFree``): both wait for work
        on the device, and when the FFN captures, attention ranks that have
        finished their own capture may already be spinning on the device for
        the FFN's reply to their next step. On one GPU under MPS a wait that
        covered their kernels would hold both sides until ``timeout_s``
        (docs/planning.md). The capture here is what that context manager
        does without those two calls: on a side stream ordered after the
        current one, into the graphs' shared pool.
        """
        # The attention role captures again after its memory profiling drops
        # its first graphs; the FFN's graph of the layout is replaced too.
        layout = plan.peer_tokens
        self._graphs.pop(layout, None)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.device(self.device):
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                graph.capture_begin(*(() if self._pool is None else (self._pool,)))
                try:
                    serve()
                finally:
                    graph.capture_end()
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[layout] = graph
        logger.debug("AFD FFN: captured the step graph of layout %s", layout)

    def replay(self, plan: Any) -> bool:
        graph = self._graphs.get(plan.peer_tokens)
        if graph is None:
            return False
        with torch.cuda.device(self.device):
            graph.replay()
        return True
