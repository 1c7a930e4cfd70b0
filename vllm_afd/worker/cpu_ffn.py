"""The AFD FFN worker and model runner for vLLM's CPU platform.

Wraps vllm/v1/worker/cpu_worker.py and cpu_model_runner.py @ 0.32.0. The
worker takes vLLM's attention-free path: no KV cache (``get_kv_cache_spec``
returns ``{}``), no warm-up forward, no generate tasks (the API server
registers no completion routes), and refuses scheduler-driven
``execute_model``. The connector-driven loop does the work.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.worker_base import CompilationTimes

from vllm_afd.errors import FFN_SERVES_NO_REQUESTS, AFDError
from vllm_afd.worker.ffn_side import FFNSideMixin
from vllm_afd.worker.runner_swap import CPU_RUNNER, swapped_runner


class AFDCPUFFNModelRunner(FFNSideMixin, CPUModelRunner):
    """``CPUModelRunner`` that runs the FFN loop instead of scheduled steps."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        self.afd_start()

    def shutdown(self) -> None:
        self.afd_close()
        super().shutdown()


class AFDCPUFFNWorker(CPUWorker):
    """``CPUWorker`` for the FFN role: no KV cache, no sampling, no requests."""

    def init_device(self) -> None:
        with swapped_runner(CPU_RUNNER, AFDCPUFFNModelRunner):
            super().init_device()

    def get_kv_cache_spec(self) -> dict:
        return {}

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def get_supported_tasks(self) -> tuple:
        return ()

    def execute_model(self, scheduler_output: Any) -> Any:
        raise AFDError(FFN_SERVES_NO_REQUESTS)

    def execute_dummy_batch(self) -> None:
        # Idle data-parallel engines step in lockstep; the FFN has no batch.
        return None
