"""The FFN role's runner behaviour, shared by the CPU and CUDA runners.

After the role-split model is loaded, the runner opens the connector and
starts :class:`~vllm_afd.worker.ffn_loop.FFNLoop` on a thread. The engine core
stays idle (it is never sent a request); the loop computes under vLLM's
forward context so the native MoE layers find themselves.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from vllm.config import CompilationMode
from vllm.distributed import get_tp_group
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.v1.worker.worker_base import CompilationTimes

from vllm_afd import envs
from vllm_afd.config import AFDConfig
from vllm_afd.connector.async_ep import AsyncFFN, ExpertSlices
from vllm_afd.connector.async_rows import SHARED_RANK
from vllm_afd.connector.payloads import A2FBatch, Routing
from vllm_afd.connector.protocol import REJOIN
from vllm_afd.errors import (
    FFN_SERVES_NO_REQUESTS,
    AFDError,
    AFDPeerError,
    AFDTimeoutError,
)
from vllm_afd.worker.async_loop import AsyncFFNLoop, describe_item
from vllm_afd.worker.compute_clock import clock_for
from vllm_afd.worker.endpoint import Endpoint, open_endpoint
from vllm_afd.worker.ffn_loop import FFNConnector, FFNLoop, StepGraphs, describe_plan
from vllm_afd.worker.metrics import endpoint_publisher
from vllm_afd.worker.profiling import StepProfiler
from vllm_afd.worker.runner_base import AFDRunnerMixin
from vllm_afd.worker.stall_watch import StallWatch
from vllm_afd.worker.tp_relay import TPRelay

logger = init_logger(__name__)


class FFNWorkerMixin:
    """The FFN role's worker behaviour, before a native worker (CPU or CUDA).

    vLLM's attention-free path: no KV cache (``get_kv_cache_spec`` is
    ``{}``), no warm-up forward, no generate tasks (the API server registers
    no completion routes), and scheduler-driven ``execute_model`` refused.
    """

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


class FFNSideMixin(AFDRunnerMixin):
    """Opens the connector and runs the FFN loop after load_model. Mixed in
    before a native model runner (CPU V1 or CUDA V2)."""

    afd_loop: FFNLoop | None = None
    afd_async_loop: AsyncFFNLoop | None = None
    #: ``async``: the routed experts this rank holds, ``[lo, hi)``
    afd_experts: tuple[int, int] | None = None

    def afd_start(self) -> None:
        vllm_config = self.vllm_config
        afd = self.model.afd  # parsed once, when the model was built
        split = self.model.afd_split
        if afd.is_async:
            self._afd_keep_own_experts(afd)
        if vllm_config.compilation_config.mode != CompilationMode.NONE:
            self._afd_compile_and_warm_up(afd)
        self.afd_endpoint = open_endpoint(vllm_config, afd, split, self.device)
        if afd.is_async:
            self._afd_serve_async(self.afd_endpoint)
            return
        self.afd_profiler = StepProfiler(
            "ffn", self.afd_endpoint.role_rank, skip=envs.profile_skip()
        )
        self._afd_serve(self._afd_loop_connector())

    def _afd_keep_own_experts(self, afd: AFDConfig) -> None:
        """``async``: this FFN rank keeps the weights of its expert slice only."""
        split = self.model.afd_split
        slices = ExpertSlices(split.num_experts, afd.num_ffn_ranks)
        rank = afd.rank or 0
        lo, hi = slices.bounds(rank)
        runs_shared = rank == SHARED_RANK
        kept, before = self.model.keep_ffn_experts(lo, hi, keep_shared=runs_shared)
        self.afd_experts = (lo, hi)
        logger.info(
            "AFD async: ffn rank %d keeps routed experts %d..%d of %d: %d of %d "
            "bytes of routed-expert weights%s",
            rank, lo, hi - 1, split.num_experts, kept, before,
            "" if runs_shared or not split.shared_experts
            else "; shared experts run on ffn rank 0",
        )  # fmt: skip

    def _afd_serve_async(self, endpoint: Endpoint) -> None:
        """The ``async`` connector: serve work items (``worker.async_loop``)."""
        work = endpoint.work
        assert isinstance(work, AsyncFFN)  # FFN ranks have TP 1 on async
        compute = self._afd_compute
        if self.device.type != "cpu":
            compute = self._afd_compute_staged
        loop = self.afd_async_loop = AsyncFFNLoop(
            work,
            compute,
            on_exit=self._afd_async_loop_exited,
            clock=clock_for(self.device),
            # async waits for its work items on the host: no caveat to add
            watch=_stall_watch(endpoint, describe_item),
        )
        self.afd_metrics = endpoint_publisher("ffn", endpoint.role_rank, work, loop)
        loop.start()

    def _afd_async_loop_exited(self, error: BaseException | None) -> None:
        """Every attention rank shut down: to rendezvous again (one lost an
        FFN rank: this rank re-forms the session with them), or for good
        (the deployment stops). An attention rank lost (an error): this FFN
        rank's server stops."""
        loop = self.afd_async_loop
        if loop is not None and loop.stopping:
            return
        endpoint = self.afd_endpoint
        work = endpoint.work if endpoint is not None else None
        again = work.rejoining() if isinstance(work, AsyncFFN) else None
        if error is None and again is not None:
            self._afd_rejoin_in_background(again)
            return
        failed = work.failed_peers() if isinstance(work, AsyncFFN) else []
        if error is None and not failed and envs.keep_ffn_alive():
            return
        why = "attention peers shut down" if error is None else f"loop failed: {error}"
        if failed:
            why = f"an attention rank failed ({'; '.join(failed)})"
        died = isinstance(error, AFDPeerError) or bool(failed)
        envs.note_stop(why, peer_died=died)
        if endpoint is not None:
            endpoint.close(f"ffn rank {endpoint.role_rank} stops: {why}")
        self._afd_stop_server(why)

    def _afd_loop_connector(self) -> FFNConnector:
        """What the FFN loop talks to: the endpoint's connector, or with
        tensor parallelism a :class:`TPRelay` over it (TP rank 0) or over
        nothing (the other TP ranks)."""
        endpoint = self.afd_endpoint
        assert endpoint is not None
        tp_group = get_tp_group()
        if tp_group.world_size == 1:
            assert endpoint.connector is not None  # TP rank 0 always has one
            return endpoint.connector
        split = endpoint.split
        gate_on_attention = endpoint.afd.compute_gate_on_attention
        return TPRelay(
            endpoint.connector,
            tp_group,
            hidden_size=split.hidden_size,
            dtype=self.vllm_config.model_config.dtype,
            device=self.device,
            routing_top_k=split.top_k if gate_on_attention else None,
        )

    def _afd_serve(self, connector: FFNConnector) -> None:
        """Run an FFN loop (and its metrics) over ``connector``."""
        endpoint = self.afd_endpoint
        assert endpoint is not None and self.afd_profiler is not None
        self.afd_loop = FFNLoop(
            connector,
            self._afd_compute,
            endpoint.split.remote_layers,
            on_exit=self._afd_loop_exited,
            on_step=self.afd_profiler.step,
            graphs=self._afd_step_graphs(),
            clock=clock_for(self.device),
            watch=_stall_watch(
                endpoint,
                describe_plan,
                DEVICE_WAITS if self.device.type != "cpu" else "",
            ),
        )
        if endpoint.connector is not None:
            self.afd_metrics = endpoint_publisher(
                "ffn", endpoint.role_rank, endpoint.connector, self.afd_loop
            )
        self.afd_loop.start()

    def _afd_rejoin_in_background(self, why: str) -> None:
        """:meth:`_afd_rendezvous_again` off the loop's thread: the
        rendezvous waits for the others."""
        threading.Thread(
            target=self._afd_rendezvous_again,
            args=(why,),
            name="afd-ffn-rejoin",
            daemon=True,
        ).start()

    def _afd_rendezvous_again(self, why: str) -> None:
        """The session ended for a rendezvous again (``why``): close this
        endpoint, open a new one (waits up to ``connect_timeout_s``, for the
        restarted rank too), serve it; the server stops when that fails.
        With tensor parallelism only TP rank 0 has a connector: the other TP
        ranks start their new loop at once and wait in it for TP rank 0's
        first plan. On ``async`` the rank keeps its expert slice."""
        old = self.afd_endpoint
        assert old is not None
        exchanges = old.connector is not None or old.work is not None
        if exchanges:
            logger.warning(
                "AFD ffn rank %d: %s; the deployment re-forms, rendezvous again "
                "at %s:%d",
                old.role_rank, why, old.afd.host, old.afd.port,
            )  # fmt: skip
        if self.afd_metrics is not None:
            self.afd_metrics.stop()
            self.afd_metrics = None
        old.close(f"{REJOIN}ffn rank {old.role_rank} re-forms the deployment: {why}")
        try:
            self.afd_endpoint = open_endpoint(
                self.vllm_config, old.afd, old.split, self.device
            )
        except AFDError as e:
            self.afd_endpoint = None
            self._afd_stop_server(f"the rendezvous again failed: {e}")
            return
        if exchanges:
            logger.info("AFD ffn rank %d: serving again", old.role_rank)
        if self.afd_endpoint.work is not None:
            self._afd_serve_async(self.afd_endpoint)
        else:
            self._afd_serve(self._afd_loop_connector())

    def _afd_step_graphs(self) -> StepGraphs | None:
        """CUDA graphs of whole steps, where the device has them."""
        return None

    def _afd_compile_and_warm_up(self, afd: AFDConfig) -> None:
        """Compile the remote layers and run each once per shape class.

        Done before the connector opens, so the attention role waits at the
        rendezvous rather than inside a step.
        """
        model = self.model
        split = model.afd_split
        model.compile_ffn()
        start = time.perf_counter()
        for num_tokens in (1, 2):
            hidden = torch.zeros(
                num_tokens,
                split.hidden_size,
                dtype=self.vllm_config.model_config.dtype,
                device=self.device,
            )
            for layer_idx in split.remote_layers:
                routing = None
                if afd.compute_gate_on_attention and layer_idx in split.moe_layers:
                    k = split.top_k
                    device = self.device
                    routing = Routing(
                        topk_weights=torch.full(
                            (num_tokens, k), 1.0 / k, device=device
                        ),
                        topk_ids=self._afd_warm_up_ids(k).repeat(num_tokens, 1),
                    )
                self._afd_compute(layer_idx, A2FBatch(hidden=hidden, routing=routing))
        logger.info(
            "AFD FFN: compiled and warmed up %d layers in %.1f s",
            len(split.remote_layers),
            time.perf_counter() - start,
        )

    def _afd_warm_up_ids(self, k: int) -> torch.Tensor:
        """``[k]`` expert ids this rank holds, for warm-up routing."""
        lo, hi = self.afd_experts or (0, self.model.afd_split.num_experts)
        ids = lo + torch.arange(k, dtype=torch.int32) % (hi - lo)
        return ids.to(self.device)

    def _afd_compute(self, layer_idx: int, batch: A2FBatch) -> torch.Tensor:
        hidden = batch.hidden
        with (
            torch.inference_mode(),
            set_forward_context(None, self.vllm_config, num_tokens=hidden.shape[0]),
        ):
            return self.model.compute_ffn(layer_idx, hidden, batch.routing)

    def _afd_compute_staged(self, layer_idx: int, batch: A2FBatch) -> torch.Tensor:
        """:meth:`_afd_compute` on this rank's GPU for a work item that
        arrived in host memory (``async``; one in a ``cuda_ipc`` slot is
        there already); the endpoint's reply moves the output where it goes."""
        return self._afd_compute(layer_idx, batch.to(self.device))

    def _afd_loop_exited(self, error: BaseException | None) -> None:
        endpoint = self.afd_endpoint
        connector = endpoint.connector if endpoint is not None else None
        loop = self.afd_loop
        # the loop's own connector: with tensor parallelism a TPRelay, which
        # knows the leader's reason on every TP rank
        served = loop.connector if loop is not None else connector
        stopping = loop is not None and loop.stopping
        again = getattr(served, "rejoining", None) if error is None else None
        if (
            isinstance(error, (AFDPeerError, AFDTimeoutError))
            and served is connector
            and connector is not None
            and not stopping
        ):
            # A step failed mid-way, e.g. this rank was stopped or cut off
            # and its attention ranks gave up on it: rendezvous again unless
            # one of them died. (With FFN tensor parallelism the other TP
            # ranks are inside the step: the server stops, to be restarted.)
            again = connector.rejoin_after_failure()
        if again is not None and not stopping:
            self._afd_rejoin_in_background(again)
            return
        if self.afd_profiler is not None:
            self.afd_profiler.close()  # on the loop's thread, which traced
        if error is None and envs.keep_ffn_alive():
            return
        why = "attention peers shut down" if error is None else f"loop failed: {error}"
        gone = None
        if connector is not None and served is connector:
            gone = connector.peer_gone
        if error is None:
            envs.note_stop(why)  # for good: a launcher stops its node
        elif gone is not None:
            # An attention rank cannot rejoin a running deployment: a launcher
            # stops this node with an error instead of restarting this rank.
            envs.note_stop(gone, peer_died=True)
        if error is None and endpoint is not None and connector is not None:
            # Say so to the session's members now (FFN rank 0: the ranks not
            # served by it): a member that only saw this process's sockets
            # close, later, when the server is gone, would take it for a
            # crash and rendezvous again instead of stopping.
            connector.close(f"ffn rank {endpoint.role_rank} stops: {why}")
        self._afd_stop_server(why)

    def _afd_stop_server(self, why: str) -> None:
        pid = envs.server_pid()
        if pid is None:
            return
        logger.info("AFD FFN role stopping its server (pid %d): %s", pid, why)
        os.kill(pid, signal.SIGTERM)

    def afd_close(self) -> None:
        if self.afd_loop is not None:
            self.afd_loop.stop()
            self.afd_loop = None
        if self.afd_async_loop is not None:
            self.afd_async_loop.stop()
            self.afd_async_loop = None
        super().afd_close()


#: the stall log's caveat where the FFN's waits for rows run on the device
DEVICE_WAITS = (
    "on a GPU the waits for the attention ranks' rows can run on the device "
    "(cuda_ipc, nccl), so a late attention rank can hold a launch too: see "
    "their logs"
)


def _stall_watch(
    endpoint: Endpoint, describe: Callable[[Any], str], note: str = ""
) -> StallWatch | None:
    """The loop's stall watch: half the connector's ``timeout_s``, so that a
    stalled phase is logged before the attention ranks give up on it."""
    timeout_s = endpoint.afd.connector_extra_config.get("timeout_s")
    if not timeout_s:
        return None
    name = f"ffn rank {endpoint.role_rank}"
    if endpoint.tp_rank:
        name += f" (tp rank {endpoint.tp_rank})"
    return StallWatch(name, timeout_s / 2, describe, note)
