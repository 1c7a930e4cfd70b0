"""What both roles' AFD runners add to a native vLLM model runner.

Mixed in before the native runner class (CPU V1 or CUDA V2): after
``load_model`` the role's :meth:`afd_start` opens the connector; on
``shutdown`` :meth:`afd_close` stops the profiler and the metrics publisher
and closes the connector, which tells the peers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_afd import lifeline
from vllm_afd.worker.endpoint import Endpoint
from vllm_afd.worker.identity import remember_config
from vllm_afd.worker.metrics import MetricsPublisher
from vllm_afd.worker.profiling import StepProfiler

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

    from vllm_afd.models.protocols import RoleSplitModel


class AFDRunnerMixin:
    # Set by the native runner this is mixed in before (declared for the type
    # checker only; nothing is assigned here).
    vllm_config: VllmConfig
    model: RoleSplitModel  # built by the role's model class (``models/``)
    device: torch.device

    afd_endpoint: Endpoint | None = None
    afd_metrics: MetricsPublisher | None = None
    afd_profiler: StepProfiler | None = None

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        remember_config(self.vllm_config)  # as loaded: building may write to it
        super().load_model(*args, **kwargs)  # type: ignore[misc]  # native runner, next in the MRO
        self.afd_start()

    def shutdown(self) -> None:
        self.afd_close()
        super().shutdown()  # type: ignore[misc]  # native runner, next in the MRO
        # The connector is closed (the peers were told): once its server is
        # gone this process need not finish the interpreter's teardown (its
        # last garbage collections take seconds on a busy host).
        lifeline.done()

    def afd_start(self) -> None:
        raise NotImplementedError

    def afd_close(self) -> None:
        """Stop profiling and metrics, close the connector. Idempotent."""
        if self.afd_profiler is not None:
            self.afd_profiler.close()
            self.afd_profiler = None
        if self.afd_metrics is not None:
            self.afd_metrics.stop()
            self.afd_metrics = None
        if self.afd_endpoint is not None:
            self.afd_endpoint.close()
            self.afd_endpoint = None
