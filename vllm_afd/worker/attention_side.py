"""The attention role's runner behaviour, shared by the CPU and CUDA runners."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from typing import Any

from vllm.distributed import get_tp_group
from vllm.logger import init_logger

from vllm_afd import envs
from vllm_afd.compat import dp_vote
from vllm_afd.compat.patching import Patch, check_patch
from vllm_afd.connector import factory
from vllm_afd.connector.async_ep import AsyncAttention
from vllm_afd.connector.connector import AFDConnector
from vllm_afd.connector.protocol import ExecMode
from vllm_afd.errors import AFDError, AFDFFNUnavailable
from vllm_afd.models.async_exchange import AsyncAttentionExchange
from vllm_afd.models.exchange import (
    AttentionExchange,
    current_exchange,
    install_exchange,
)
from vllm_afd.models.layout import ModelSplit
from vllm_afd.models.moe_tail import closing_add_fused
from vllm_afd.serving import ffn_status
from vllm_afd.serving.ffn_status import LinkState
from vllm_afd.worker.endpoint import Endpoint, open_endpoint
from vllm_afd.worker.ffn_link import FFNLink
from vllm_afd.worker.metrics import StatsSource, endpoint_publisher
from vllm_afd.worker.profiling import StepProfiler
from vllm_afd.worker.runner_base import AFDRunnerMixin
from vllm_afd.worker.ubatching import UBatchSwitch, ubatch_token_counts

logger = init_logger(__name__)


def warn_if_not_bit_exact(vllm_config: Any, split: ModelSplit) -> None:
    """Say so when AFD output may differ from plain vLLM in the last bits.

    Compiled 16-bit models ship each MoE layer's shared and routed outputs
    apart, so the attention role adds them as plain vLLM does (see
    ``vllm_afd.models.moe_tail``). That needs shared experts; without them
    the MoE output crosses the connector rounded, where compiled vLLM fuses it
    into the next norm unrounded.
    """
    if closing_add_fused(vllm_config) and split.moe_output_parts == 1:
        dtype = vllm_config.model_config.dtype
        logger.warning(
            "AFD with %s, torch.compile and a model without shared experts: "
            "greedy output can differ from plain vLLM in rare near-ties (the "
            "MoE output crosses the connector rounded to %s). Use "
            "--enforce-eager or float32 for bit-exact parity",
            dtype,
            dtype,
        )


def stop_engine_on_lost_peer(message: str) -> None:
    """End this engine process at once when its FFN rank is gone (CUDA).

    A FULL CUDA graph replay waits for the FFN's transfers on the device, where
    no host timeout reaches, and a step cut short by an aborted transfer would
    sample garbage. Killing the process makes vLLM fail the in-flight requests
    and stop the server, as it does when an engine dies.
    """
    logger.error(
        "AFD attention role: %s; the NCCL data plane cannot time out inside "
        "CUDA graphs, so this engine stops now and in-flight requests fail",
        message,
    )
    logging.shutdown()
    os.kill(os.getpid(), signal.SIGKILL)


def checked_output(
    output: Any,
    connector: AFDConnector,
    link: FFNLink[AFDConnector] | FFNLink[AsyncAttention] | None = None,
) -> Any:
    """``output`` of a CUDA step, which reaches the scheduler only after the
    connector's device-side checks of that step passed (cuda_ipc: a timed-out,
    aborted or desynchronised exchange raises instead of sampling garbage).

    With an FFN ``link`` a failed check takes the link down and raises
    :class:`AFDFFNUnavailable`, which fails the step's requests only.
    """

    def check() -> None:
        if link is None:
            connector.check()
            return
        try:
            connector.check()
        except AFDError as e:
            link.lost(str(e))
            raise AFDFFNUnavailable(str(e)) from e

    get_output = getattr(output, "get_output", None)
    if get_output is None:  # already on the host: the step finished
        if output is not None:
            check()
        return output

    def get_checked() -> Any:
        result = get_output()  # waits for the step's copies to the host
        check()
        return result

    output.get_output = get_checked
    return output


_GRAPHS = "vllm.v1.worker.gpu.cudagraph_utils:ModelCudaGraphManager"
GRAPH_CAPTURE = Patch(
    target=f"{_GRAPHS}.capture",
    expected_params=None,  # wrapped as (*args, **kwargs): parameters pass through
    reason="attention role: a forward that records piecewise CUDA graphs, "
    "which hold the exchanges, must send a CAPTURE plan",
    removal="when vLLM's forward context says whether piecewise graphs record",
)
GRAPH_REPLAY = Patch(
    target=f"{_GRAPHS}.run_fullgraph",
    expected_params=("self", "desc"),
    reason="attention role: a FULL graph replay never runs the forward, where "
    "plans are sent, so the FFN must be told before it",
    removal="never while FULL graphs hold the exchanges",
)


def announce_graphs(manager: Any) -> None:
    """Make ``manager`` (the V2 runner's graph manager) tell the FFN about
    graphs; wraps the instance's methods (``GRAPH_CAPTURE``, ``GRAPH_REPLAY``).

    While ``manager.capture`` records, the exchange knows it
    (``capturing_graphs``), so a forward that records piecewise graphs sends
    a CAPTURE plan. Before each FULL graph replay, which never runs the
    model's forward, a REPLAY plan of the graph's tokens is sent.
    """
    check_patch(GRAPH_CAPTURE)
    check_patch(GRAPH_REPLAY)
    capture, replay = manager.capture, manager.run_fullgraph

    def capture_graphs(*args: Any, **kwargs: Any) -> Any:
        exchange = current_exchange()
        exchange.capturing_graphs = True
        try:
            return capture(*args, **kwargs)
        finally:
            exchange.capturing_graphs = False

    def run_fullgraph(desc: Any) -> Any:
        tokens = desc.num_tokens
        if desc.num_ubatches > 1:
            tokens = ubatch_token_counts(desc.num_tokens, desc.num_ubatches)
        current_exchange().begin_step(tokens, ExecMode.REPLAY)
        return replay(desc)

    manager.capture = capture_graphs
    manager.run_fullgraph = run_fullgraph


class AttentionSideMixin(AFDRunnerMixin):
    """Opens the connector after load_model and installs the exchange the
    model's proxies call. Mixed in before a native model runner."""

    afd_link: FFNLink[AFDConnector] | FFNLink[AsyncAttention] | None = None
    afd_exchange: AttentionExchange[AFDConnector] | None = None

    def afd_start(self) -> None:
        afd = self.model.afd  # parsed once, when the model was built
        split = self.model.afd_split
        warn_if_not_bit_exact(self.vllm_config, split)
        endpoint = open_endpoint(self.vllm_config, afd, split, self.device)
        self.afd_endpoint = endpoint
        if afd.is_async:
            self._afd_start_async(endpoint)
            return
        link = None
        if endpoint.connector is not None:
            connector = endpoint.connector
            stats_of: StatsSource
            if connector.device.type == "cuda" and not connector.bounded_wait:
                connector.watch_peers(stop_engine_on_lost_peer)
                stats_of = connector
            else:
                link = self.afd_link = open_link(self.vllm_config, endpoint)
                stats_of = link
            self.afd_metrics = endpoint_publisher(
                "attention", endpoint.role_rank, stats_of, link=link,
                ubatched_steps=self._afd_ubatched_steps,
            )  # fmt: skip
        self.afd_profiler = StepProfiler(
            "attention", endpoint.role_rank, skip=envs.profile_skip()
        )
        tp_group = get_tp_group()
        self.afd_exchange = AttentionExchange(
            endpoint.connector,
            tp_group if tp_group.world_size > 1 else None,
            on_step=self.afd_profiler.step,
            switch=UBatchSwitch() if afd.num_ubatches > 1 else None,
            link=link,
        )
        install_exchange(self.afd_exchange)

    def _afd_start_async(self, endpoint: Endpoint) -> None:
        """The ``async`` connector: no plans; a link over the endpoint (see
        ``models.async_exchange``) that re-forms the session when an FFN rank
        is lost."""
        work = endpoint.work
        assert isinstance(work, AsyncAttention)  # attention ranks have TP 1
        link = open_async_link(endpoint, work)
        self.afd_link = link
        self.afd_metrics = endpoint_publisher(
            "attention", endpoint.role_rank, link, link=link,
            ubatched_steps=self._afd_ubatched_steps,
        )  # fmt: skip
        self.afd_profiler = StepProfiler(
            "attention", endpoint.role_rank, skip=envs.profile_skip()
        )
        self.afd_exchange = AsyncAttentionExchange(
            work, endpoint.split.shared_experts, on_step=self.afd_profiler.step,
            link=link,
        )  # fmt: skip
        install_exchange(self.afd_exchange)

    def _afd_ubatched_steps(self) -> int:
        exchange = self.afd_exchange
        return 0 if exchange is None else exchange.ubatched_steps

    # A step that ran without its FFN rank fails its requests, and only them:
    # the forward ran to its end (the exchange served zeros), the runner's
    # state is whole, and AFDFFNUnavailable reaches the engine core, which
    # ends those requests with an error (``compat.engine_step``).
    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        link = self.afd_link
        if link is None:
            return super().execute_model(*args, **kwargs)  # type: ignore[misc]  # native runner, next in the MRO
        exchange = self.afd_exchange
        assert exchange is not None  # afd_start installs it with the link
        with link.step():
            exchange.failure = None
            output = super().execute_model(*args, **kwargs)  # type: ignore[misc]  # native runner, next in the MRO
        if output is not None and exchange.failure is not None:
            failure, exchange.failure = exchange.failure, None
            raise AFDFFNUnavailable(failure)
        return output  # None: sample_tokens follows

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        output = super().sample_tokens(*args, **kwargs)  # type: ignore[misc]  # native runner, next in the MRO
        exchange = self.afd_exchange
        if exchange is not None and exchange.failure is not None:
            failure, exchange.failure = exchange.failure, None
            raise AFDFFNUnavailable(failure)
        # The connector of this step (a link's may be replaced by now).
        connector = exchange.connector if exchange is not None else None
        if connector is not None and connector.device.type == "cuda":
            output = checked_output(output, connector, self.afd_link)
        return output

    def _dummy_run(self, *args: Any, **kwargs: Any) -> Any:
        link = self.afd_link
        if link is None:
            return super()._dummy_run(*args, **kwargs)  # type: ignore[misc]  # native runner, next in the MRO
        exchange = self.afd_exchange
        assert exchange is not None  # afd_start installs it with the link
        with link.step():
            try:
                return super()._dummy_run(*args, **kwargs)  # type: ignore[misc]  # native runner, next in the MRO
            finally:
                exchange.failure = None  # no request to fail

    def afd_close(self) -> None:
        install_exchange(None)
        if self.afd_link is not None:
            dp_vote.uninstall()
            self.afd_link.close()
            self.afd_link = None
            self.afd_endpoint = None  # its connector was the link's
        super().afd_close()


def open_async_link(
    endpoint: Endpoint, first: AsyncAttention
) -> FFNLink[AsyncAttention]:
    """The FFN link of this attention rank over its started ``async``
    endpoint: a lost FFN rank takes the link down (503 naming it) and a new
    endpoint is opened once every FFN rank is back. No vote between
    data-parallel ranks: the FFN ranks take work items from any attention
    rank, so each goes live on its own."""
    afd, rank = endpoint.afd, endpoint.role_rank

    def reconnect() -> AsyncAttention:
        work = factory.create_async_endpoint(
            afd, rank, endpoint.fingerprint, endpoint.limits
        )
        assert isinstance(work, AsyncAttention)
        work.start()
        return work

    return FFNLink(
        first, reconnect, attention_rank=rank, ffn_rank=0, publish=_link_publisher()
    )


def _link_publisher() -> Callable[[LinkState], None]:
    """Publishes a link's states for this server's API (``serving.ffn_status``);
    does nothing outside a server."""
    server_pid = envs.server_pid()

    def publish(state: LinkState) -> None:
        if server_pid is not None:
            ffn_status.publish(server_pid, state)

    return publish


def open_link(vllm_config: Any, endpoint: Endpoint) -> FFNLink[AFDConnector]:
    """The FFN link of this attention rank over its started connector; it
    publishes its state for this server's API (``serving.ffn_status``)."""
    afd, rank, first = endpoint.afd, endpoint.role_rank, endpoint.connector
    assert first is not None  # only an endpoint with a connector opens a link

    def reconnect() -> AFDConnector:
        connector = factory.create_connector(
            afd, rank, endpoint.fingerprint, first.device, endpoint.limits,
        )  # fmt: skip
        connector.start()
        return connector

    # Data-parallel ranks go live together after a rejoin: they vote in
    # vLLM's per-forward DP coordination (``compat.dp_vote``).
    aligned = vllm_config.parallel_config.data_parallel_size > 1
    link = FFNLink(
        first,
        reconnect,
        attention_rank=rank,
        ffn_rank=endpoint.topology.ffn_peer(rank),
        publish=_link_publisher(),
        aligned=aligned,
    )
    if aligned:
        dp_vote.install(link)
    return link
