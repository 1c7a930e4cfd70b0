"""The FFN role's runner behaviour, shared by the CPU and CUDA runners.

After the role-split model is loaded, the runner opens the connector and
starts :class:`~vllm_afd.worker.ffn_loop.FFNLoop` on a thread. The engine core
stays idle (it is never sent a request); the loop computes under vLLM's
forward context so the native MoE layers find themselves.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger

from vllm_afd import envs
from vllm_afd.errors import AFDConfigError
from vllm_afd.models.deepseek import afd_config_of
from vllm_afd.worker.endpoint import Endpoint, open_endpoint
from vllm_afd.worker.ffn_loop import FFNLoop
from vllm_afd.worker.metrics import MetricsPublisher, endpoint_publisher

logger = init_logger(__name__)


class FFNSideMixin:
    """Opens the connector and runs the FFN loop after load_model."""

    afd_endpoint: Endpoint | None = None
    afd_loop: FFNLoop | None = None
    afd_metrics: MetricsPublisher | None = None

    def afd_start(self) -> None:
        vllm_config = self.vllm_config  # type: ignore[attr-defined]
        afd = afd_config_of(vllm_config)
        if vllm_config.parallel_config.tensor_parallel_size > 1:
            raise AFDConfigError(
                "tensor parallelism on the AFD FFN role is not supported yet; "
                "use --tensor-parallel-size 1 on the FFN role"
            )
        endpoint = open_endpoint(vllm_config, afd, self.device)  # type: ignore[attr-defined]
        self.afd_endpoint = endpoint
        model = self.model  # type: ignore[attr-defined]
        self.afd_loop = FFNLoop(
            endpoint.connector,
            self._afd_compute,
            model.remote_layers,
            on_exit=self._afd_loop_exited,
        )
        self.afd_metrics = endpoint_publisher(
            "ffn", endpoint.role_rank, endpoint.connector, self.afd_loop
        )
        self.afd_loop.start()

    def _afd_compute(self, layer_idx: int, batch: Any) -> torch.Tensor:
        hidden = batch.hidden
        with (
            torch.inference_mode(),
            set_forward_context(
                None,
                self.vllm_config,  # type: ignore[attr-defined]
                num_tokens=hidden.shape[0],
            ),
        ):
            return self.model.compute_ffn(layer_idx, hidden)  # type: ignore[attr-defined]

    def _afd_loop_exited(self, error: BaseException | None) -> None:
        if error is None and envs.keep_ffn_alive():
            return
        pid = envs.server_pid()
        if pid is None:
            return
        logger.info(
            "AFD FFN role stopping its server (pid %d): %s",
            pid,
            "attention peers shut down" if error is None else f"loop failed: {error}",
        )
        os.kill(pid, signal.SIGTERM)

    def afd_close(self) -> None:
        if self.afd_loop is not None:
            self.afd_loop.stop()
            self.afd_loop = None
        if self.afd_metrics is not None:
            self.afd_metrics.stop()
            self.afd_metrics = None
        if self.afd_endpoint is not None:
            self.afd_endpoint.close()
            self.afd_endpoint = None
