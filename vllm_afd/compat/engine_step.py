"""An attention step without its FFN rank fails its requests, not the engine.

vLLM's engine core treats any exception from the model executor as fatal:
it dumps the batch, stops the engine, and the API server exits. The AFD
attention runner raises :class:`~vllm_afd.errors.AFDFFNUnavailable` for a
step that ran without its FFN rank (``worker.attention_side``); these patches
turn that one exception into a request-level failure:

* every request of the engine ends with ``FinishReason.ERROR`` (the client
  gets an error: HTTP 500, or an error event in a stream), none with a token
  of the failed step;
* the KV blocks that step wrote (positions from ``num_computed_tokens -
  num_in_flight_tokens`` on) leave the prefix cache, so no later request
  reuses them; the rest of the prefix cache stays;
* the engine goes on stepping, and the batch dump is skipped for it.

Any other exception keeps vLLM's behaviour. Installed in the engine process
of an AFD server (``vllm_afd.register``); the FFN role's engine never steps.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from typing import Any

from vllm_afd.compat.patching import Patch, apply_patch
from vllm_afd.errors import FFN_UNAVAILABLE

logger = logging.getLogger(__name__)

_CORE = "vllm.v1.engine.core:EngineCore"
STEP = Patch(
    target=f"{_CORE}.step",
    expected_params=("self",),
    reason="a step that ran without its FFN rank fails its requests, not the engine",
    removal="when vLLM's engine core fails requests on a request-level error "
    "from the executor",
)
STEP_WITH_BATCH_QUEUE = Patch(
    target=f"{_CORE}.step_with_batch_queue",
    expected_params=("self",),
    reason=STEP.reason,
    removal=STEP.removal,
)
LOG_ERROR_DETAIL = Patch(
    target=f"{_CORE}.log_error_detail",
    expected_params=("self", "scheduler_output"),
    reason="no batch dump (an ERROR page) for a step that lost its FFN rank",
    removal=STEP.removal,
)


def ffn_unavailable(error: BaseException) -> str | None:
    """The AFDFFNUnavailable message in ``error`` or its causes, if any (a
    worker process's exception reaches the engine as a string)."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e)
        at = text.find(FFN_UNAVAILABLE)
        if at >= 0:
            return text[at:].split("', please check")[0]
        e = e.__cause__ or e.__context__
    return None


def _evict_unconfirmed_blocks(scheduler: Any, request: Any) -> set[int]:
    """Blocks of ``request`` holding tokens no step has confirmed yet."""
    start = request.num_computed_tokens - request.num_in_flight_tokens
    try:
        groups = scheduler.kv_cache_manager.get_block_ids(request.request_id)
    except (KeyError, AttributeError):
        return set()
    specs = scheduler.kv_cache_config.kv_cache_groups
    out: set[int] = set()
    for g, ids in enumerate(groups):
        size = specs[g].kv_cache_spec.block_size if g < len(specs) else None
        size = size or scheduler.block_size
        out.update(ids[max(start, 0) // size :])
    return out


def fail_all_requests(engine: Any, why: str) -> dict[int, Any]:
    """End every request of ``engine`` with an error; their outputs by client."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.request import RequestStatus

    scheduler = engine.scheduler
    stale: set[int] = set()
    for request in list(scheduler.requests.values()):
        stale |= _evict_unconfirmed_blocks(scheduler, request)
    if stale:
        scheduler.kv_cache_manager.evict_blocks(stale)
    failed = scheduler.finish_requests(None, RequestStatus.FINISHED_ERROR)
    by_client: dict[int, list[Any]] = defaultdict(list)
    for request in failed:
        by_client[request.client_index].append(
            EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR)
        )
    logger.error(
        "%s; %d request(s) of engine %d end with an error, %d KV block(s) leave "
        "the prefix cache; the engine keeps running",
        why, len(failed), getattr(engine, "engine_index", 0), len(stale),
    )  # fmt: skip
    return {
        client: EngineCoreOutputs(
            engine_index=getattr(engine, "engine_index", 0),
            outputs=outputs,
            finished_requests={o.request_id for o in outputs},
        )
        for client, outputs in by_client.items()
    }


def _step(original: Any) -> Any:
    @functools.wraps(original)
    def step(self: Any) -> Any:
        try:
            return original(self)
        except Exception as e:
            why = ffn_unavailable(e)
            if why is None:
                raise
            # The forward ran (to its end, with zeros): it counts as executed,
            # which keeps data-parallel engines in lockstep (an engine that
            # did not execute runs a dummy batch, one collective too many).
            return fail_all_requests(self, why), True

    return step


def _log_error_detail(original: Any) -> Any:
    import contextlib

    @functools.wraps(original)
    @contextlib.contextmanager
    def log_error_detail(self: Any, scheduler_output: Any) -> Any:
        try:
            yield
        except Exception as e:
            if ffn_unavailable(e) is not None:
                raise
            with original(self, scheduler_output):
                raise

    return log_error_detail


def install() -> None:
    """Patch the engine core of this process (idempotent)."""
    apply_patch(STEP, _step)
    apply_patch(STEP_WITH_BATCH_QUEUE, _step)
    apply_patch(LOG_ERROR_DETAIL, _log_error_detail)
