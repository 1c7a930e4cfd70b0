"""The engine-config hook: AFD settings applied when vLLM builds its config.

Wraps ``vllm/engine/arg_utils.py:EngineArgs.create_engine_config`` @ 0.32.0,
which every ``vllm serve`` (and ``LLM(...)``) calls in the front-end process
before any engine or worker process starts. For a run without the ``afd`` key
the wrapper calls the original and returns; with it, the wrapper

1. parses ``additional_config["afd"]`` (phase 1; config errors surface here),
2. records whether ``worker_cls`` was ``"auto"``,
3. registers every supported architecture's role-split AFD model class
   (``vllm_afd.models.split``) with vLLM's ``ModelRegistry``, the way vLLM
   means out-of-tree models to be added (the engine and worker processes of
   the server do the same in the plugin's ``register``, see
   :func:`register_afd_models`; a user's ``model_class_overrides`` still
   wins),
4. calls the original, then selects the AFD worker and checks the result
   against the ``VllmConfig`` (phase 2).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import TYPE_CHECKING, Any

from vllm_afd import envs
from vllm_afd.compat import independent_ranks, metrics_dir
from vllm_afd.compat.patching import Patch, apply_patch
from vllm_afd.compat.workers import (
    CPU_DEFAULT_WORKER,
    CUDA_DEFAULT_WORKER,
    check_runner_generation,
    select_worker,
)
from vllm_afd.config import AFDConfig, afd_config_from_additional
from vllm_afd.errors import AFDConfigError
from vllm_afd.topology import endpoint_rank

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

CREATE_ENGINE_CONFIG = Patch(
    target="vllm.engine.arg_utils:EngineArgs.create_engine_config",
    expected_params=("self", "usage_context", "headless"),
    reason="parse and validate additional_config['afd'] and select the AFD "
    "worker before any worker process starts",
    removal="when vLLM offers a config-validation / worker-selection hook",
)


def afd_model_classes() -> dict[str, str]:
    """Native architecture -> qualified name of its role-split AFD class."""
    from vllm_afd.models.families import SUPPORTED_ARCHS

    return {arch: f"vllm_afd.models.split:AFD{arch}" for arch in SUPPORTED_ARCHS}


def register_afd_models() -> None:
    """Map every supported architecture to its AFD class in this process's
    ``ModelRegistry``. Called only in the processes of an AFD server."""
    from vllm import ModelRegistry

    for arch, target in afd_model_classes().items():
        ModelRegistry.register_model(arch, target)


def platform_default_worker() -> str:
    """The worker vLLM's current platform picks for ``worker_cls="auto"``."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return CPU_DEFAULT_WORKER
    if current_platform.is_cuda():
        return CUDA_DEFAULT_WORKER
    return f"<no AFD worker for platform {current_platform.device_type!r}>"


def install() -> None:
    """Wrap ``EngineArgs.create_engine_config`` (idempotent)."""
    apply_patch(CREATE_ENGINE_CONFIG, _wrap_create_engine_config)


def _wrap_create_engine_config(original: Any) -> Any:
    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> VllmConfig:
        afd = afd_config_from_additional(self.additional_config)
        if afd is None:
            return original(self, *args, **kwargs)
        from vllm_afd import raise_if_registration_failed

        raise_if_registration_failed()
        parent_server = envs.server_pid()
        envs.mark_server_process()
        _enable_worker_metrics()
        worker_cls_was_auto = self.worker_cls == "auto"
        register_afd_models()
        if independent_ranks.applies(afd):
            config = _with_independent_ranks(original, self, *args, **kwargs)
        else:
            config = original(self, *args, **kwargs)
        apply_afd_to_vllm_config(config, afd, worker_cls_was_auto=worker_cls_was_auto)
        from vllm_afd.serving import stop_log

        stop_log.install()
        if afd.is_ffn:
            from vllm_afd.serving import ffn_refusal

            ffn_refusal.install()
        else:
            from vllm_afd.compat import engine_step, engine_stop
            from vllm_afd.serving import ffn_availability

            engine_step.install()  # before the engine process forks, if it does
            engine_stop.install()  # its workers' SHUTDOWN tells a stop from a crash
            # With data parallelism vLLM serves the API from child processes
            # that build their config again; the ranks write under the pid of
            # the server that started the engines, their parent.
            if parent_server is not None and parent_server == os.getppid():
                ffn_availability.install(parent_server, owner=False)
            else:
                ffn_availability.install(os.getpid())
        return config

    return create_engine_config


def _with_independent_ranks(
    original: Any, engine_args: Any, *args: Any, **kwargs: Any
) -> VllmConfig:
    """``original`` with the model config marked as it is created, before
    vLLM reads ``is_moe`` from it (``compat.independent_ranks``)."""
    create = engine_args.create_model_config

    def create_model_config(*a: Any, **k: Any) -> Any:
        model_config = create(*a, **k)
        independent_ranks.mark(model_config)
        return model_config

    engine_args.create_model_config = create_model_config
    try:
        return original(engine_args, *args, **kwargs)
    finally:
        del engine_args.create_model_config


def _enable_worker_metrics() -> None:
    """Let counters written by worker processes reach this server's /metrics.

    Prometheus multiprocess mode, set before the engine starts, as vLLM does
    itself when it runs several API servers.
    """
    from prometheus_client import values

    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir.make()
    values.ValueClass = values.get_value_class()


def apply_afd_to_vllm_config(
    config: VllmConfig, afd: AFDConfig, *, worker_cls_was_auto: bool
) -> None:
    """Phase 2: select the worker and check ``afd`` against ``config``.

    Raises:
        AFDCompatError: worker selection or runner generation is wrong.
        AFDConfigError: the AFD settings contradict the vLLM settings.
    """
    platform_default = platform_default_worker()
    parallel = config.parallel_config
    parallel.worker_cls = select_worker(
        afd.role,
        parallel.worker_cls,
        was_auto=worker_cls_was_auto,
        platform_default=platform_default,
    )
    check_runner_generation(platform_default, config.use_v2_model_runner)
    validate_against_vllm(config, afd)
    if afd.is_ffn:
        # The FFN role holds no KV cache (an empty KV cache spec); vLLM's
        # prefix-caching KV manager needs at least one cache group.
        config.cache_config.enable_prefix_caching = False
        from vllm.platforms import current_platform

        if (
            current_platform.is_cpu()
            and config.cache_config.kv_cache_memory_bytes is None
        ):
            # vLLM's CPU worker refuses to start unless gpu_memory_utilization
            # (0.92) of the node's RAM is free, to hold a KV cache this role
            # never has. A KV cache size of 0 skips that check.
            config.cache_config.kv_cache_memory_bytes = 0
    # Normalised copy for the workers: they re-parse it, so keep it plain.
    config.additional_config["afd"] = afd.to_dict()


def validate_against_vllm(config: VllmConfig, afd: AFDConfig) -> None:
    """Check the AFD settings against the built ``VllmConfig``.

    Raises:
        AFDConfigError: naming the AFD key and the vLLM setting that clash.
    """
    check_architecture(config.model_config.architectures[0])
    parallel = config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise AFDConfigError(
            f"AFD needs --pipeline-parallel-size 1, got "
            f"{parallel.pipeline_parallel_size}"
        )
    topology = afd.topology
    dp_rank, dp_size = independent_ranks.data_parallel_place(parallel, afd)
    endpoint_rank(
        topology, afd.role, dp_rank=dp_rank, dp_size=dp_size, tp_rank=0,
        ffn_rank=afd.rank,
    )  # fmt: skip
    if config.speculative_config is not None:
        raise AFDConfigError("AFD does not support speculative decoding yet")
    if afd.is_ffn and config.kv_transfer_config is not None:
        from vllm_afd.deploy.spec import ffn_kv_refusal

        raise AFDConfigError(ffn_kv_refusal())
    if getattr(parallel, "use_sequence_parallel_moe", False):
        raise AFDConfigError(
            "AFD does not support sequence-parallel MoE (the MoE block gathers "
            "its tokens across TP ranks around the runner); turn off "
            "--use-sequence-parallel-moe"
        )
    if parallel.use_ubatching:
        raise AFDConfigError(
            "AFD does not use vLLM's micro-batching (--enable-dbo, "
            "--ubatch-size > 1), which overlaps an expert all-to-all; set "
            "afd.num_ubatches (e.g. 2) to overlap attention with the FFN role"
        )
    if afd.is_async:
        check_async_supported(afd, parallel, config.compilation_config)
    if afd.num_ubatches > 1 and afd.is_attention:
        check_ubatches_supported(afd, parallel)
    if afd.attention_ranks_per_device > 1:
        check_device_sharing_supported(afd)
    if afd.is_attention:
        from vllm.compilation.breakable_cudagraph import (
            is_breakable_cudagraph_enabled,
        )

        check_graph_mode(config.compilation_config, is_breakable_cudagraph_enabled())


def check_architecture(arch: str) -> None:
    """AFD serves the architectures of :mod:`vllm_afd.models.families`.

    Raises:
        AFDConfigError: naming the architecture, why it has no record where
            that is known (``registry_table.TRIED``), and the supported ones.
    """
    from vllm_afd.models.families import SUPPORTED_ARCHS, family_of
    from vllm_afd.models.registry_table import TRIED

    if family_of(arch) is None:
        # what trying it found, where it was tried (docs/models.md's table)
        why = f" ({TRIED[arch]})" if arch in TRIED else ""
        raise AFDConfigError(
            f"AFD does not support architecture {arch!r}: no family record in "
            f"vllm_afd.models.families{why}; supported: {', '.join(SUPPORTED_ARCHS)}"
        )


def check_graph_mode(compilation: Any, breakable: bool) -> None:
    """The attention role cannot run vLLM's breakable piecewise CUDA graphs.

    A breakable graph (``VLLM_USE_BREAKABLE_CUDAGRAPH=1``, which vLLM also
    turns on by itself for some models and for batch-invariant bf16) replays
    the whole forward without running the model's Python, where the step plan
    is sent: the FFN would never hear of the step. vLLM's compiled piecewise
    graphs run the forward and announce each replay.

    Raises:
        AFDConfigError: naming the variable and the settings that work.
    """
    if breakable and compilation.cudagraph_mode.has_piecewise_cudagraphs():
        raise AFDConfigError(
            "the AFD attention role cannot run vLLM's breakable CUDA graphs "
            f"(VLLM_USE_BREAKABLE_CUDAGRAPH=1 with cudagraph_mode "
            f"{compilation.cudagraph_mode.name}): their replay skips the model's "
            "forward, where the FFN role is told about each step. Set "
            "VLLM_USE_BREAKABLE_CUDAGRAPH=0, or --compilation-config "
            '\'{"cudagraph_mode": "FULL_DECODE_ONLY"}\', or --enforce-eager'
        )


def check_async_supported(afd: AFDConfig, parallel: Any, compilation: Any) -> None:
    """What the ``async`` connector runs on today: CPU, or CUDA with the
    attention role eager or in piecewise CUDA graphs (:func:`split_at_exchange`);
    one TP rank per rank (an FFN rank takes work items from any attention
    rank in arrival order, which its TP ranks would have to agree on first).

    Raises:
        AFDConfigError: naming the connector and the setting that clashes.
    """
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        if afd.is_attention:
            split_at_exchange(compilation)
    elif not current_platform.is_cpu():
        raise AFDConfigError(
            f"afd.connector='async' moves CPU or CUDA tensors over TCP; this "
            f"platform is {current_platform.device_type}, where it is not "
            "supported. Use the p2p connector (with compute_gate_on_attention=true)"
        )
    if parallel.tensor_parallel_size != 1:
        raise AFDConfigError(
            f"afd.connector='async' with --tensor-parallel-size "
            f"{parallel.tensor_parallel_size} is not supported yet: use more "
            "ranks instead (afd.num_attention_ranks, afd.num_ffn_ranks)"
        )


def split_at_exchange(compilation: Any) -> None:
    """The ``async`` attention role's CUDA graphs: piecewise, split at the
    exchange (``models.exchange.SPLITTING_OP``, added to vLLM's splitting
    ops), which then runs eagerly between two graphs: the host sends each
    work item's header over TCP, which no graph can hold. vLLM's default
    ``FULL_AND_PIECEWISE`` becomes ``PIECEWISE`` (logged); a mode with FULL
    graphs only is refused.

    Raises:
        AFDConfigError: naming cudagraph_mode and the settings that work.
    """
    from vllm.config import CUDAGraphMode

    from vllm_afd.models.exchange import SPLITTING_OP

    mode = compilation.cudagraph_mode
    if mode == CUDAGraphMode.NONE:
        return
    if mode == CUDAGraphMode.FULL_AND_PIECEWISE:
        logger.warning(
            "AFD: afd.connector='async' runs the attention role in piecewise "
            "CUDA graphs only (a FULL graph would hold the exchange, whose "
            "work items' headers the host sends): cudagraph_mode "
            "FULL_AND_PIECEWISE -> PIECEWISE"
        )
        compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE
    elif mode != CUDAGraphMode.PIECEWISE:
        raise AFDConfigError(
            "afd.connector='async' on CUDA runs the attention role in piecewise "
            "CUDA graphs or eagerly: a FULL graph would hold the exchange, "
            f"whose work items' headers the host sends (cudagraph_mode is "
            f"{mode.name}). Pass --compilation-config "
            '\'{"cudagraph_mode": "PIECEWISE"}\', or --enforce-eager'
        )
    if not compilation.splitting_ops:
        raise AFDConfigError(
            "afd.connector='async' with cudagraph_mode PIECEWISE needs vLLM's "
            "splitting ops (compilation mode VLLM_COMPILE, splitting_ops not "
            "set to []): the exchange runs between two graphs. Pass "
            "--enforce-eager, or leave splitting_ops to vLLM"
        )
    if SPLITTING_OP not in compilation.splitting_ops:
        compilation.splitting_ops.append(SPLITTING_OP)


def check_device_sharing_supported(afd: AFDConfig) -> None:
    """Attention ranks share devices on CUDA only.

    Raises:
        AFDConfigError: naming afd.attention_ranks_per_device and the platform.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        raise AFDConfigError(
            f"afd.attention_ranks_per_device={afd.attention_ranks_per_device} "
            f"places attention ranks on CUDA devices; this platform is "
            f"{current_platform.device_type}. Use 1"
        )


def check_ubatches_supported(afd: AFDConfig, parallel: Any) -> None:
    """Micro-batching needs one attention TP rank, and the CUDA V2 runner
    (``p2p``) or the CPU runner (``async``, request-boundary stages).

    Raises:
        AFDConfigError: naming afd.num_ubatches and the setting that clashes.
    """
    from vllm.platforms import current_platform

    if afd.is_async:
        if current_platform.is_cuda():
            raise AFDConfigError(
                f"afd.num_ubatches={afd.num_ubatches} with the async connector "
                "splits steps at request boundaries on CPU only so far (the "
                "CUDA runner does not cut steps into stages yet). Use "
                "afd.num_ubatches=1"
            )
    elif not current_platform.is_cuda():
        raise AFDConfigError(
            f"afd.num_ubatches={afd.num_ubatches} with the p2p connector needs "
            "CUDA (vLLM's V2 model runner); this platform is "
            f"{current_platform.device_type}. Use afd.num_ubatches=1, or the "
            "async connector (request-boundary stages)"
        )
    if parallel.tensor_parallel_size != 1:
        raise AFDConfigError(
            f"afd.num_ubatches={afd.num_ubatches} with "
            f"--tensor-parallel-size {parallel.tensor_parallel_size} on the "
            "attention role is not supported yet; use one of them"
        )
