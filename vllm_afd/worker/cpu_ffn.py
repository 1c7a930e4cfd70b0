"""The AFD FFN worker and model runner for vLLM's CPU platform.

Wraps vllm/v1/worker/cpu_worker.py and cpu_model_runner.py @ 0.32.0. The
worker takes vLLM's attention-free path (:class:`FFNWorkerMixin`); the
connector-driven loop (:class:`FFNSideMixin`) does the work on a thread.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_afd.worker.ffn_side import FFNSideMixin, FFNWorkerMixin
from vllm_afd.worker.runner_swap import CPU_RUNNER, swapped_runner


class AFDCPUFFNModelRunner(FFNSideMixin, CPUModelRunner):
    """``CPUModelRunner`` that runs the FFN loop instead of scheduled steps."""


class AFDCPUFFNWorker(FFNWorkerMixin, CPUWorker):
    """``CPUWorker`` for the FFN role: no KV cache, no sampling, no requests."""

    def init_device(self) -> None:
        with swapped_runner(CPU_RUNNER, AFDCPUFFNModelRunner):
            super().init_device()
