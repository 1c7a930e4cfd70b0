"""The attention role's runner behaviour, shared by the CPU and CUDA runners."""

from __future__ import annotations

from vllm.distributed import get_tp_group
from vllm.logger import init_logger

from vllm_afd.models.deepseek import afd_config_of
from vllm_afd.models.exchange import AttentionExchange, install_exchange
from vllm_afd.worker.endpoint import Endpoint, open_endpoint
from vllm_afd.worker.metrics import MetricsPublisher, endpoint_publisher

logger = init_logger(__name__)


class AttentionSideMixin:
    """Starts the connector after load_model; closes it on shutdown."""

    afd_endpoint: Endpoint | None = None
    afd_metrics: MetricsPublisher | None = None

    def afd_start(self) -> None:
        afd = afd_config_of(self.vllm_config)  # type: ignore[attr-defined]
        endpoint = open_endpoint(
            self.vllm_config,  # type: ignore[attr-defined]
            afd,
            self.device,  # type: ignore[attr-defined]
        )
        self.afd_endpoint = endpoint
        if endpoint.connector is not None:
            self.afd_metrics = endpoint_publisher(
                "attention", endpoint.role_rank, endpoint.connector
            )
        tp_group = get_tp_group()
        install_exchange(
            AttentionExchange(
                endpoint.connector, tp_group if tp_group.world_size > 1 else None
            )
        )

    def afd_close(self) -> None:
        install_exchange(None)
        if self.afd_metrics is not None:
            self.afd_metrics.stop()
            self.afd_metrics = None
        if self.afd_endpoint is not None:
            self.afd_endpoint.close()
            self.afd_endpoint = None
