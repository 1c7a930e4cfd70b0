"""The AFD attention worker and model runner for vLLM's CPU platform.

Wraps vllm/v1/worker/cpu_worker.py and cpu_model_runner.py @ 0.32.0 (the V1
model runner: CPU cannot run V2, which needs Triton). Everything is native
(scheduler, KV cache, batching, attention, sampling, output) except that the
runner starts the connector once the role-split model is loaded, and closes
it on shutdown (:class:`AttentionSideMixin`).
"""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_afd.worker.attention_side import AttentionSideMixin
from vllm_afd.worker.runner_swap import CPU_RUNNER, swapped_runner


class AFDCPUAttentionModelRunner(AttentionSideMixin, CPUModelRunner):
    """``CPUModelRunner`` whose model exchanges with the FFN role."""


class AFDCPUAttentionWorker(CPUWorker):
    """``CPUWorker`` running :class:`AFDCPUAttentionModelRunner`."""

    def init_device(self) -> None:
        with swapped_runner(CPU_RUNNER, AFDCPUAttentionModelRunner):
            super().init_device()
