"""Micro-batched steps on the CUDA attention role (``afd.num_ubatches = 2``).

Dual-batch overlap: a step's tokens are split in two micro-batches, and
micro-batch 1's attention runs while micro-batch 0's activations are in
transfer or on the FFN role, and the other way round::

    attention GPU   attn L0 ub0 | attn L0 ub1 | attn L1 ub0 | attn L1 ub1 | ...
    FFN GPU                       ffn L0 ub0  | ffn L0 ub1  | ffn L1 ub0  | ...

vLLM 0.32's V2 model runner already runs micro-batches: one thread per
micro-batch, each with its own forward context and attention metadata, handing
the GPU to the other at ``dbo_yield`` (vllm/v1/worker/gpu/ubatch_utils.py).
It does so only for data-parallel expert all-to-all, so this module switches
the same machinery on for an attention role with one rank:

* :func:`enable_ubatching` turns vLLM's ``enable_dbo`` on in the attention
  worker's own config, after vLLM validated it, so the workspace, attention
  metadata builders and CUDA graph manager plan for two micro-batches.
* :func:`build_ubatch_runner` builds vLLM's ``UBatchRunner`` although
  data parallelism is 1 (vLLM builds it only for DP > 1).
* :func:`dispatch_with_ubatches` splits every step that meets vLLM's own
  thresholds (``--dbo-decode-token-threshold``, default 32 tokens,
  ``--dbo-prefill-token-threshold``, default 512): the DP > 1 path of
  ``dispatch_cg_and_sync_dp`` without the cross-rank vote.
* :class:`AFDUBatchRunner` stages each split's token counts; micro-batch 0's
  forward sends them in the step plan.

The exchange of micro-batch i sends its A2F, posts its F2A receive and yields
(``vllm_afd.models.exchange``). The transfers of one step are therefore
issued in the order the FFN serves them (layer by layer, micro-batch by
micro-batch), which one NCCL stream between the roles needs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from vllm.config import CUDAGraphMode
from vllm.forward_context import create_forward_context
from vllm.logger import init_logger
from vllm.v1.worker import ubatching as vllm_ubatching
from vllm.v1.worker.gpu.ubatch_utils import UBatchRunner, UBatchState
from vllm.v1.worker.ubatch_utils import check_ubatch_thresholds, get_num_ubatches

from vllm_afd.compat.patching import Patch, apply_patch, check_patch, scoped_patch
from vllm_afd.config import AFDConfig

logger = init_logger(__name__)

_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"

BUILD_UBATCH_RUNNER = Patch(
    target=f"{_RUNNER_MODULE}:maybe_build_ubatch_runner",
    expected_params=(
        "vllm_config",
        "device",
        "model_state",
        "attn_groups",
        "kv_cache_config",
        "max_num_reqs",
    ),
    reason="build the micro-batch runner for one attention rank (vLLM needs DP > 1)",
    removal="when vLLM micro-batches without data parallelism",
)

DISPATCH = Patch(
    target=f"{_RUNNER_MODULE}:dispatch_cg_and_sync_dp",
    expected_params=(
        "cudagraph_manager",
        "num_reqs",
        "num_tokens",
        "uniform_token_count",
        "dp_size",
        "dp_rank",
        "max_query_len",
        "need_eager",
        "num_active_loras",
        "parallel_config",
        "allow_ubatching",
        "uniform_decode",
        "dp_sync_state",
    ),
    reason="split steps into micro-batches on one attention rank (vLLM needs DP > 1)",
    removal="when vLLM micro-batches without data parallelism",
)


FORWARD_CONTEXTS = Patch(
    target="vllm.v1.worker.gpu.ubatch_utils:UBatchRunner._make_forward_contexts",
    expected_params=(
        "self",
        "ubatch_slices",
        "attn_metadata",
        "slot_mappings_by_layer",
        "is_padding",
    ),
    reason="micro-batch forward contexts without data-parallel metadata (DP = 1)",
    removal="when vLLM micro-batches without data parallelism",
)

#: all-to-all backends vLLM's config accepts with micro-batching
_DBO_ALL2ALL = ("deepep_low_latency", "deepep_high_throughput", "nixl_ep")


def ubatch_token_counts(num_tokens: int, num_ubatches: int) -> tuple[int, ...]:
    """Tokens per micro-batch of a ``num_tokens`` (padded) step.

    vLLM splits at ``num_tokens // num_ubatches`` and pads the last
    micro-batch to the step's size (``maybe_create_ubatch_slices``); a FULL
    graph replay never calls it, so its plan is computed here.
    """
    split = num_tokens // num_ubatches
    return (split,) * (num_ubatches - 1) + (num_tokens - split * (num_ubatches - 1),)


class UBatchSwitch:
    """Which micro-batch the calling thread runs, and the hand-off to the next.

    The default asks vLLM's ``vllm.v1.worker.ubatching``; tests drive the
    exchange with their own threads through the same three calls.
    """

    def active(self) -> bool:
        """True inside a micro-batch thread."""
        return vllm_ubatching.dbo_enabled()

    def index(self) -> int:
        return vllm_ubatching.dbo_current_ubatch_id()

    def yield_(self) -> None:
        """Let the next micro-batch run until it yields back."""
        vllm_ubatching.dbo_yield()


def enable_ubatching(vllm_config: Any, afd: AFDConfig) -> None:
    """Turn micro-batching on in this attention worker's config.

    Called before the worker builds its workspace and model runner. vLLM's
    ``--enable-dbo`` cannot be passed instead: it is reserved for expert
    all-to-all backends and refused otherwise at config time.
    """
    if afd.num_ubatches < 2:
        return
    parallel = vllm_config.parallel_config
    parallel.enable_dbo = True
    assert get_num_ubatches(parallel) == afd.num_ubatches
    # vLLM re-validates copies of the config during warm-up; its DBO checks
    # ask for a DBO-capable all-to-all backend (the attention role runs no
    # MoE, so none is ever used) and for the V2 runner chosen explicitly (it
    # is: the worker refuses V1).
    if parallel.all2all_backend not in _DBO_ALL2ALL:
        parallel.all2all_backend = _DBO_ALL2ALL[0]
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    apply_patch(DISPATCH, _dispatch_with_ubatches_over)
    logger.info(
        "AFD attention role: %d micro-batches per step from %d decode / %d "
        "prefill tokens (--dbo-decode-token-threshold, "
        "--dbo-prefill-token-threshold)",
        afd.num_ubatches,
        parallel.dbo_decode_token_threshold,
        parallel.dbo_prefill_token_threshold,
    )


def _dispatch_with_ubatches_over(original: Callable[..., Any]) -> Callable[..., Any]:
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        return dispatch_with_ubatches(original, *args, **kwargs)

    return dispatch


def dispatch_with_ubatches(
    original: Callable[..., Any],
    cudagraph_manager: Any,
    num_reqs: int,
    num_tokens: int,
    uniform_token_count: int | None,
    dp_size: int,
    dp_rank: int,
    max_query_len: int | None = None,
    need_eager: bool = False,
    num_active_loras: int = 0,
    parallel_config: Any = None,
    allow_ubatching: bool = False,
    uniform_decode: bool = False,
    dp_sync_state: Any = None,
) -> tuple[Any, Any]:
    """``dispatch_cg_and_sync_dp`` that micro-batches with one DP rank.

    With data parallelism vLLM decides the split in a cross-rank vote; with
    one rank the vote is this rank's own answer to the same questions.
    """
    num_ubatches = get_num_ubatches(parallel_config) if parallel_config else 1
    if (
        dp_size == 1
        and allow_ubatching
        and not need_eager
        and dp_sync_state is None
        and cudagraph_manager is not None
        and num_tokens >= num_ubatches > 1
        and check_ubatch_thresholds(parallel_config, num_tokens, uniform_decode)
    ):
        desc = cudagraph_manager.dispatch(
            num_reqs,
            num_tokens,
            uniform_token_count,
            num_active_loras=num_active_loras,
            num_ubatches=num_ubatches,
        )
        if 2 * num_tokens < desc.num_tokens:
            # The graph's padding would leave the last micro-batch empty.
            desc = _eager(desc, num_tokens, num_reqs, num_ubatches)
        return desc, None
    return original(
        cudagraph_manager,
        num_reqs,
        num_tokens,
        uniform_token_count,
        dp_size,
        dp_rank,
        max_query_len=max_query_len,
        need_eager=need_eager,
        num_active_loras=num_active_loras,
        parallel_config=parallel_config,
        allow_ubatching=allow_ubatching,
        uniform_decode=uniform_decode,
        dp_sync_state=dp_sync_state,
    )


def _eager(desc: Any, num_tokens: int, num_reqs: int, num_ubatches: int) -> Any:
    """An eager micro-batched descriptor for this step."""
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    return BatchExecutionDescriptor(
        cg_mode=CUDAGraphMode.NONE,
        num_tokens=num_tokens,
        num_reqs=num_reqs,
        num_active_loras=desc.num_active_loras,
        num_ubatches=num_ubatches,
    )


class AFDUBatchRunner(UBatchRunner):
    """vLLM's micro-batch runner on one rank; each split's token counts go to
    the plan."""

    def __init__(self, *args: Any, stage: Callable[[tuple[int, ...]], None]) -> None:
        super().__init__(*args)
        self._stage = stage

    def prepare(self, *args: Any, **kwargs: Any) -> UBatchState:
        state = super().prepare(*args, **kwargs)
        self._stage(tuple(s.num_tokens for s in state.slices))
        return state

    def _make_forward_contexts(
        self,
        ubatch_slices: Any,
        attn_metadata: list[dict[str, Any]],
        slot_mappings_by_layer: list[dict[str, Any]],
        is_padding: list[Any],
    ) -> list[Any]:
        return make_forward_contexts(
            self.vllm_config, attn_metadata, slot_mappings_by_layer, is_padding
        )


def make_forward_contexts(
    vllm_config: Any,
    attn_metadata: list[dict[str, Any]],
    slot_mappings_by_layer: list[dict[str, Any]],
    is_padding: list[Any],
) -> list[Any]:
    """One forward context per micro-batch, without data-parallel metadata.

    vLLM's runner gives each context the micro-batch's token count across DP
    ranks, for the expert all-to-all; with one rank and no MoE on this role
    there is none (vLLM asserts DP > 1 when asked for it).
    """
    return [
        create_forward_context(
            metadata,
            vllm_config,
            cudagraph_runtime_mode=CUDAGraphMode.NONE,
            slot_mapping=slots,
            is_padding=padding,
        )
        for metadata, slots, padding in zip(
            attn_metadata, slot_mappings_by_layer, is_padding, strict=True
        )
    ]


def build_ubatch_runner(stage: Callable[[tuple[int, ...]], None]) -> Any:
    """A ``maybe_build_ubatch_runner`` for one attention rank."""

    def build(
        vllm_config: Any,
        device: Any,
        model_state: Any,
        attn_groups: Any,
        kv_cache_config: Any,
        max_num_reqs: int,
    ) -> UBatchRunner | None:
        if not vllm_config.parallel_config.use_ubatching:
            return None
        check_patch(FORWARD_CONTEXTS)  # AFDUBatchRunner overrides it
        return AFDUBatchRunner(
            vllm_config,
            device,
            model_state,
            attn_groups,
            kv_cache_config,
            max_num_reqs,
            stage=stage,
        )

    return build


def ubatch_runner_for_one_rank(stage: Callable[[tuple[int, ...]], None]) -> Any:
    """Context in which the V2 runner builds :class:`AFDUBatchRunner`."""
    return scoped_patch(BUILD_UBATCH_RUNNER, build_ubatch_runner(stage))
