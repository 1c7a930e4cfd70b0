"""The AFD attention worker and model runner for vLLM's CUDA platform.

Wraps vllm/v1/worker/gpu_worker.py and gpu/model_runner.py @ 0.32.0 (the V2
model runner, CUDA's default). Everything is native (scheduler, KV cache,
batching, attention, sampling, output, CUDA graphs) except that the runner
starts the connector once the role-split model is loaded, closes it on
shutdown, and tells the FFN role when CUDA graphs are recorded and when a
FULL graph is replayed: a FULL replay never runs the model's forward, where
the other plans are sent. With ``afd.num_ubatches = 2`` it runs vLLM's
micro-batch runner on one rank (:mod:`vllm_afd.worker.ubatching`); with
``afd.attention_ranks_per_device`` above 1, several ranks share a GPU
(:mod:`vllm_afd.worker.device_sharing`).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from vllm_afd.compat.workers import CUDA_DEFAULT_WORKER, check_runner_generation
from vllm_afd.config import afd_config_of
from vllm_afd.models.exchange import current_exchange
from vllm_afd.worker.attention_side import AttentionSideMixin, announce_graphs
from vllm_afd.worker.device_sharing import sharing_devices
from vllm_afd.worker.runner_swap import CUDA_RUNNER, swapped_runner
from vllm_afd.worker.ubatching import enable_ubatching, ubatch_runner_for_one_rank


def require_v2_runner(worker: Worker) -> None:
    """Refuse to start on the V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``).

    Raises:
        AFDCompatError: the worker was configured for the V1 runner.
    """
    check_runner_generation(CUDA_DEFAULT_WORKER, bool(worker.use_v2_model_runner))


class AFDAttentionModelRunner(AttentionSideMixin, GPUModelRunner):
    """V2 ``GPUModelRunner`` whose model exchanges with the FFN role."""

    # The native runner assigns its CUDA graph manager in __init__ and again in
    # each initialize_kv_cache; every manager it assigns announces its graphs.
    @property
    def cudagraph_manager(self) -> Any:
        return self.__dict__.get("_afd_cudagraph_manager")

    @cudagraph_manager.setter
    def cudagraph_manager(self, manager: Any) -> None:
        if manager is not None:
            announce_graphs(manager)
        self.__dict__["_afd_cudagraph_manager"] = manager

    def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> Any:
        # Builds the micro-batch runner (when enabled) and the graph manager.
        with ubatch_runner_for_one_rank(_stage_ubatches):
            return super().initialize_kv_cache(*args, **kwargs)


def _stage_ubatches(ubatch_tokens: tuple[int, ...]) -> None:
    current_exchange().stage_ubatches(ubatch_tokens)


class AFDAttentionWorker(Worker):
    """GPU ``Worker`` running :class:`AFDAttentionModelRunner`."""

    def init_device(self) -> None:
        require_v2_runner(self)
        afd = afd_config_of(self.vllm_config)
        enable_ubatching(self.vllm_config, afd)
        with (
            swapped_runner(CUDA_RUNNER, AFDAttentionModelRunner),
            sharing_devices(self, afd.attention_ranks_per_device),
        ):
            super().init_device()
