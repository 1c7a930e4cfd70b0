"""The AFD FFN worker and model runner for vLLM's CUDA platform.

Wraps vllm/v1/worker/gpu_worker.py and gpu/model_runner.py @ 0.32.0 (the V2
model runner). Same behaviour as the CPU FFN worker: vLLM's attention-free
path (``get_kv_cache_spec`` returns ``{}``), no warm-up forward and no CUDA
graph capture of its own, no generate tasks, and scheduler-driven
``execute_model`` is refused. The connector-driven loop (:class:`FFNSideMixin`)
does the work on a thread of its own, and records and replays step graphs when
the attention role captures and replays CUDA graphs, FULL or piecewise
(:mod:`.ffn_graphs`).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from vllm_afd.connector.payloads import A2FBatch
from vllm_afd.worker.cuda_attention import require_v2_runner
from vllm_afd.worker.ffn_graphs import CudaStepGraphs
from vllm_afd.worker.ffn_side import FFNSideMixin, FFNWorkerMixin
from vllm_afd.worker.runner_swap import CUDA_RUNNER, swapped_runner


class AFDFFNModelRunner(FFNSideMixin, GPUModelRunner):
    """V2 ``GPUModelRunner`` that runs the FFN loop instead of scheduled steps."""

    def _afd_step_graphs(self) -> CudaStepGraphs:
        # The step graphs mirror the attention role's CUDA graphs.
        return CudaStepGraphs(self.device)

    def _afd_compute(self, layer_idx: int, batch: A2FBatch) -> torch.Tensor:
        # The loop runs on its own thread, whose current CUDA device is not
        # inherited from the thread that set up the worker.
        with torch.cuda.device(self.device):
            return super()._afd_compute(layer_idx, batch)


class AFDFFNWorker(FFNWorkerMixin, Worker):
    """GPU ``Worker`` for the FFN role: no KV cache, no sampling, no requests."""

    def init_device(self) -> None:
        require_v2_runner(self)
        with swapped_runner(CUDA_RUNNER, AFDFFNModelRunner):
            super().init_device()

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        # Attention-free: nothing to allocate. The V2 runner's KV-cache set-up
        # (block tables, attention metadata builders, CUDA graph manager)
        # serves scheduled steps only, which the FFN never runs.
        self.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
