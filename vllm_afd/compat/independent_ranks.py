"""The ``async`` connector's attention ranks step on their own.

vLLM 0.32 runs the data-parallel ranks of an MoE model in lockstep
(``DPEngineCoreProc``): every step the ranks agree on a padded token count in
one all-reduce, an idle rank runs a dummy forward so that its expert
all-to-all meets the others', and request waves start and end together (the
DP coordinator). The ranks of a dense model are independent engines instead
(vllm/v1/engine/core.py, ``run_engine_core``: each engine's config set to
data-parallel size 1, its rank kept as ``data_parallel_index``; the API
server still balances requests over them). vLLM tells the two apart by
``ModelConfig.is_moe``: whether the model's architecture config counts
experts.

An AFD attention rank holds no experts. With the synchronous ``p2p``
connector the lockstep is what keeps an FFN block's attention ranks stepping
together (the FFN rank merges their step plans, and they vote in that
all-reduce to go live together after a rejoin, ``compat.dp_vote``). With the
``async`` connector nothing needs it: an FFN rank takes work items from any
attention rank in arrival order, and each attention rank rejoins on its own.
So the ``async`` attention role with several ranks builds its model config
with no experts counted in its architecture config (:func:`mark`), and
vLLM treats it as it treats a dense model wherever it reads ``is_moe``:
independent engines, no coordinator waves, no expert-parallel group (the
role has no experts), no expert-parallel weight filter. The model itself is
built from the checkpoint's config, experts and all (the split then drops
them on this role); its MoE blocks ask for the expert-parallel group as they
are built (GLM-4.5's does), so while vLLM initializes its process groups
the count is restored (:data:`PROCESS_GROUPS`) and the group exists, of one
rank. A step of one attention rank then never waits for another: no dummy
forward, no per-step all-reduce between them.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_afd.compat.patching import Patch, apply_patch
from vllm_afd.config import AFDConfig

#: where :func:`mark` keeps the expert count it hid
HIDDEN = "afd_num_experts"

PROCESS_GROUPS = Patch(
    target="vllm.distributed.parallel_state:initialize_model_parallel",
    expected_params=None,
    reason="an async attention rank running as an independent engine still "
    "builds MoE blocks that ask for the expert-parallel group",
    removal="when vLLM runs an MoE model's data-parallel ranks without "
    "lockstep on request",
)


def applies(afd: AFDConfig) -> bool:
    """Whether this role's data-parallel ranks run as independent engines:
    the ``async`` connector's attention role with several ranks."""
    return not afd.is_ffn and afd.is_async and afd.num_attention_ranks > 1


def mark(model_config: Any) -> None:
    """Have vLLM treat ``model_config``'s model as dense for data
    parallelism (``is_moe`` False): its architecture config counts no
    experts. The mark travels with the config to the engine processes."""
    arch = model_config.model_arch_config
    setattr(arch, HIDDEN, arch.num_experts)
    arch.num_experts = 0


def install() -> None:
    """Restore a marked config's expert count while vLLM initializes its
    process groups, so that it builds the expert-parallel group (in an AFD
    server's worker processes; idempotent)."""
    apply_patch(PROCESS_GROUPS, _with_experts_counted)


def _with_experts_counted(original: Any) -> Any:
    @functools.wraps(original)
    def initialize_model_parallel(*args: Any, **kwargs: Any) -> Any:
        from vllm.config import get_current_vllm_config

        model_config = get_current_vllm_config().model_config
        arch: Any = getattr(model_config, "model_arch_config", None)
        hidden = getattr(arch, HIDDEN, None)
        if hidden is None:
            return original(*args, **kwargs)
        arch.num_experts = hidden
        try:
            return original(*args, **kwargs)
        finally:
            arch.num_experts = 0

    return initialize_model_parallel


def data_parallel_place(parallel: Any, afd: AFDConfig) -> tuple[int, int]:
    """(rank, size) of this process's engine among the role's data-parallel
    ranks: vLLM's, or, for an independent engine (whose config says size 1),
    the rank vLLM keeps as ``data_parallel_index`` and the role's count."""
    if applies(afd) and parallel.data_parallel_size == 1:
        return parallel.data_parallel_index, afd.num_attention_ranks
    return parallel.data_parallel_rank, parallel.data_parallel_size
