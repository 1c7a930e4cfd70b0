"""The AFD attention worker and model runner for vLLM's CUDA platform.

Wraps vllm/v1/worker/gpu_worker.py and gpu/model_runner.py @ 0.32.0 (the V2
model runner, CUDA's default). Everything is native (scheduler, KV cache,
batching, attention, sampling, output) except that the runner starts the
connector once the role-split model is loaded, and closes it on shutdown.
"""

from __future__ import annotations

from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from vllm_afd.compat.workers import CUDA_DEFAULT_WORKER, check_runner_generation
from vllm_afd.worker.attention_side import AttentionSideMixin
from vllm_afd.worker.runner_swap import CUDA_RUNNER, swapped_runner


def require_v2_runner(worker: Worker) -> None:
    """Refuse to start on the V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``).

    Raises:
        AFDCompatError: the worker was configured for the V1 runner.
    """
    check_runner_generation(CUDA_DEFAULT_WORKER, bool(worker.use_v2_model_runner))


class AFDAttentionModelRunner(AttentionSideMixin, GPUModelRunner):
    """V2 ``GPUModelRunner`` whose model exchanges with the FFN role."""


class AFDAttentionWorker(Worker):
    """GPU ``Worker`` running :class:`AFDAttentionModelRunner`."""

    def init_device(self) -> None:
        require_v2_runner(self)
        with swapped_runner(CUDA_RUNNER, AFDAttentionModelRunner):
            super().init_device()
