"""The AFD attention worker and model runner for vLLM's CPU platform.

Wraps vllm/v1/worker/cpu_worker.py and cpu_model_runner.py @ 0.32.0 (the V1
model runner: CPU cannot run V2, which needs Triton). Everything is native
(scheduler, KV cache, batching, attention, sampling, output) except that the
runner starts the connector once the role-split model is loaded, and closes
it on shutdown (:class:`AttentionSideMixin`).

With the ``async`` connector and ``afd.num_ubatches = 2`` the runner splits
large enough steps into two stages at a request boundary
(:mod:`vllm_afd.worker.stages`): vLLM's V1 runner already builds attention
metadata per micro-batch when its batch decision says so; this runner makes
that decision (``_determine_batch_execution_and_padding``), cuts at the
request boundary (``STAGE_SLICES``) and runs the stages (``_model_forward``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from vllm import forward_context as vllm_forward_context
from vllm.forward_context import (
    create_forward_context,
    get_forward_context,
    override_forward_context,
)
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_afd.compat.patching import Patch, apply_patch
from vllm_afd.worker.attention_side import AttentionSideMixin
from vllm_afd.worker.runner_swap import CPU_RUNNER, swapped_runner
from vllm_afd.worker.stages import (
    StageBaton,
    reads_later_writes,
    stage_inputs,
    stage_split,
)

logger = init_logger(__name__)

STAGE_SLICES = Patch(
    target="vllm.v1.worker.gpu_model_runner:maybe_create_ubatch_slices",
    expected_params=(
        "should_ubatch",
        "num_scheduled_tokens",
        "num_tokens_padded",
        "num_reqs_padded",
        "num_ubatches",
        "split_point",
    ),
    reason="cut an async step's micro-batches at a request boundary (vLLM cuts "
    "at half the tokens, inside a request)",
    removal="when vLLM's V1 runner takes a split point from the model runner",
)


def _request_boundary_slices(stages: int) -> Callable[[Any], Any]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def slices(
            should_ubatch: bool,
            num_scheduled_tokens: np.ndarray,
            num_tokens_padded: int,
            num_reqs_padded: int,
            num_ubatches: int,
            split_point: list[int] | int | None = None,
        ) -> Any:
            if should_ubatch and split_point is None:
                split_point = stage_split(num_scheduled_tokens)
            return original(
                should_ubatch, num_scheduled_tokens, num_tokens_padded,
                num_reqs_padded, stages, split_point,
            )  # fmt: skip

        return slices

    return make


class AFDCPUAttentionModelRunner(AttentionSideMixin, CPUModelRunner):
    """``CPUModelRunner`` whose model exchanges with the FFN role."""

    #: the baton of an async rank that splits steps into stages (else None)
    _afd_baton: StageBaton | None = None
    #: True while execute_model runs (dummy forwards are never split)
    _afd_in_step = False

    def afd_start(self) -> None:
        super().afd_start()
        afd = self.model.afd
        if not (afd.is_async and afd.num_ubatches > 1):
            return
        apply_patch(STAGE_SLICES, _request_boundary_slices(afd.num_ubatches))
        self._afd_baton = StageBaton(self._afd_set_stage_context)
        assert self.afd_exchange is not None  # afd_start installed it
        self.afd_exchange.switch = self._afd_baton

    def initialize_metadata_builders(
        self, kv_cache_config: Any, kernel_block_sizes: list[int]
    ) -> None:
        """vLLM's builders, one set per stage when steps may run as stages
        (vLLM makes one set per micro-batch only with its own ``--enable-dbo``)."""
        super().initialize_metadata_builders(kv_cache_config, kernel_block_sizes)
        afd = self.model.afd
        if not (afd.is_async and afd.num_ubatches > 1):
            return
        recurrent = [
            type(g.kv_cache_spec).__name__
            for g in kv_cache_config.kv_cache_groups
            if not isinstance(g.kv_cache_spec, AttentionSpec)
        ]
        if recurrent:
            # a recurrent layer's state is per request, but its kernels have
            # not been checked on a split batch: such a model runs whole
            self._afd_baton = None
            if self.afd_exchange is not None:
                self.afd_exchange.switch = None
            logger.warning(
                "AFD async: this model keeps recurrent state (%s): its steps "
                "run whole, not in stages",
                ", ".join(sorted(set(recurrent))),
            )
            return
        for gid, groups in enumerate(self.attn_groups):
            for group in groups:
                group.create_metadata_builders(
                    self.vllm_config,
                    self.device,
                    kernel_block_sizes[gid] if gid < len(kernel_block_sizes) else None,
                    num_metadata_builders=afd.num_ubatches,
                )
        parallel = self.parallel_config
        logger.info(
            "AFD async: steps of 2+ requests and at least %d tokens (%d of "
            "decodes only) run as %d stages cut at a request boundary "
            "(--dbo-prefill-token-threshold, --dbo-decode-token-threshold)",
            parallel.dbo_prefill_token_threshold,
            parallel.dbo_decode_token_threshold,
            afd.num_ubatches,
        )

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        self._afd_in_step = True
        try:
            return super().execute_model(*args, **kwargs)
        finally:
            self._afd_in_step = False

    def _determine_batch_execution_and_padding(
        self,
        num_tokens: int,
        num_reqs: int,
        num_scheduled_tokens_np: np.ndarray,
        max_num_scheduled_tokens: int,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        decided = super()._determine_batch_execution_and_padding(
            num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens,
            *args, **kwargs,
        )  # fmt: skip
        if self._afd_baton is None or not self._afd_in_step:
            return decided
        mode, desc, _, across_dp, stats = decided
        staged = self._afd_stages_for(
            num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens
        )
        return mode, desc, staged, across_dp, stats

    def _afd_stages_for(
        self, num_tokens: int, num_reqs: int, tokens: np.ndarray, max_tokens: int
    ) -> bool:
        """Whether this step runs as stages (the module docstring of
        ``worker.stages`` says when)."""
        parallel = self.parallel_config
        decodes_only = max_tokens <= self.uniform_decode_query_len
        threshold = (
            parallel.dbo_decode_token_threshold
            if decodes_only
            else parallel.dbo_prefill_token_threshold
        )
        if num_reqs < 2 or num_tokens < threshold:
            return False
        query_lens = tokens[:num_reqs]
        split = stage_split(query_lens)
        assert split is not None  # two requests at least
        split_req = int(np.searchsorted(np.cumsum(query_lens), split, side="right"))
        tables = [
            (table.get_numpy_array()[:num_reqs], table.block_size)
            for table in self.input_batch.block_table.block_tables
        ]
        computed = self.input_batch.num_computed_tokens_cpu[:num_reqs]
        return not reads_later_writes(split_req, computed, query_lens, tables)

    def _model_forward(
        self,
        input_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **model_kwargs: Any,
    ) -> Any:
        context = get_forward_context()
        baton = self._afd_baton
        slices = context.ubatch_slices
        if baton is None or slices is None:
            return super()._model_forward(
                input_ids, positions, intermediate_tensors, inputs_embeds,
                **model_kwargs,
            )  # fmt: skip
        mappings = context.slot_mapping
        self._afd_stage_contexts = [
            create_forward_context(
                context.attn_metadata[i],
                self.vllm_config,
                cudagraph_runtime_mode=context.cudagraph_runtime_mode,
                batch_descriptor=context.batch_descriptor,
                slot_mapping=mappings[i] if isinstance(mappings, list) else None,
                additional_kwargs=context.additional_kwargs,
                skip_compiled=context.skip_compiled,
                is_padding=(
                    None
                    if context.is_padding is None
                    else context.is_padding[s.token_slice]
                ),
            )
            for i, s in enumerate(slices)
        ]
        assert self.afd_exchange is not None  # afd_start installed it
        self.afd_exchange.stage_ubatches(tuple(s.num_tokens for s in slices))
        inputs = dict(
            input_ids=input_ids,
            positions=positions,
            intermediate_tensors=intermediate_tensors,
            inputs_embeds=inputs_embeds,
            **model_kwargs,
        )
        forward = super()._model_forward  # the native runner's, per stage
        stages = [
            functools.partial(forward, **stage_inputs(s.token_slice, inputs))
            for s in slices
        ]
        # the stage threads set the process's forward context in turn; the
        # step's own is back in place afterwards
        with override_forward_context(context):
            outputs = baton.run(stages)
        if not all(isinstance(o, torch.Tensor) for o in outputs):
            raise NotImplementedError(
                "async micro-batches need a model whose forward returns one "
                "hidden-states tensor (no pipeline parallelism, no EAGLE-3 "
                "auxiliary states)"
            )
        return torch.cat(outputs)

    def _afd_set_stage_context(self, stage: int) -> None:
        # vLLM's forward context is a module global (its own micro-batch
        # threads swap it the same way, vllm/v1/worker/ubatching.py)
        vllm_forward_context._forward_context = self._afd_stage_contexts[stage]


class AFDCPUAttentionWorker(CPUWorker):
    """``CPUWorker`` running :class:`AFDCPUAttentionModelRunner`."""

    def init_device(self) -> None:
        with swapped_runner(CPU_RUNNER, AFDCPUAttentionModelRunner):
            super().init_device()
