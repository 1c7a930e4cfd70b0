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

    def capture(self, plan: Any, serve: Callable[[], None]) -> None:
        # The attention role captures again after its memory profiling drops
        # its first graphs; the FFN's graph of the layout is replaced too.
        layout = plan.peer_tokens
        self._graphs.pop(layout, None)
        graph = torch.cuda.CUDAGraph()
        with (
            torch.inference_mode(),
            torch.cuda.device(self.device),
            torch.cuda.graph(graph, pool=self._pool),
        ):
            serve()
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
