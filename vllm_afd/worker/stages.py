"""Request-boundary micro-batches for the ``async`` connector (CPU attention role).

With ``afd.num_ubatches = 2`` and the ``async`` connector, a large enough
step of two or more requests runs as two **stages**, cut at the request
boundary nearest half its tokens, so that one stage's attention runs while
the other's work items are with the FFN ranks::

    attention rank   attn L0 s0 | attn L0 s1 | attn L1 s0 | attn L1 s1 | ...
    FFN ranks                     experts L0 s0 | experts L0 s1 | ...

No request is split: each stage is a batch of whole requests, with its own
attention metadata (vLLM's ``split_attn_metadata``), and the stages' outputs
are concatenated back in token order before sampling, so a stage computes
exactly what the whole step computes for its rows.

Each stage runs the model's forward on a thread of its own; one holds the
**baton** at a time (:class:`StageBaton`), and an exchange hands it over
between sending its work items and reading the replies
(``models.async_exchange``). vLLM's forward context is a process global,
so the baton sets the holder's before it runs on.

When a step stays whole:

* fewer than two requests (a single long prefill runs whole);
* fewer tokens than vLLM's ``--dbo-prefill-token-threshold`` (default 512),
  or for a step of decodes only ``--dbo-decode-token-threshold`` (32);
* a request of the first stage reads, by a prefix-cache hit, a KV block
  that a request of the second stage writes in this step: the first stage's
  attention of a layer runs before the second stage wrote that layer
  (:func:`reads_later_writes`);
* warm-up, profile and other dummy forwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from vllm_afd.errors import AFDConnectorError

#: how long a stage waits for the baton before the step fails: the other
#: stage holds it for at most one layer's attention plus its exchange
BATON_TIMEOUT_S = 600.0


def stage_split(num_scheduled_tokens: np.ndarray) -> int | None:
    """The token index where the second stage starts: the request boundary
    nearest half the step's tokens (the earlier one on a tie), or None for a
    step of fewer than two requests."""
    if len(num_scheduled_tokens) < 2:
        return None
    ends = np.cumsum(num_scheduled_tokens)[:-1]
    half = int(num_scheduled_tokens.sum()) / 2
    return int(ends[int(np.argmin(np.abs(ends - half)))])


def reads_later_writes(
    split_req: int,
    computed: np.ndarray,
    query_lens: np.ndarray,
    block_tables: Sequence[tuple[np.ndarray, int]],
) -> bool:
    """Whether a request before ``split_req`` (first stage) reads a whole KV
    block that a request from ``split_req`` on (second stage) writes in
    this step.

    Args:
        computed: tokens each request has in its KV cache before the step.
        query_lens: tokens each request runs in the step.
        block_tables: ``(table [num_reqs, max_blocks], block_size)`` of each
            KV cache group.
    """
    readers = np.flatnonzero((computed[:split_req] > 0) & (query_lens[:split_req] > 0))
    if readers.size == 0:
        return False
    for table, block_size in block_tables:
        written: set[int] = set()
        for r in range(split_req, len(query_lens)):
            first = computed[r] // block_size
            last = (computed[r] + query_lens[r] - 1) // block_size
            written.update(int(b) for b in table[r, first : last + 1])
        for r in readers:
            whole = computed[r] // block_size
            if any(int(b) in written for b in table[r, :whole]):
                return True
    return False


class StageBaton:
    """Which stage runs, and the hand-over between them.

    The exchange's view of it is ``models.exchange.MicroBatchSwitch``:
    :meth:`active` (this thread runs a stage), :meth:`index` and
    :meth:`yield_` (let the other stage run until it hands the baton back or
    ends).

    Args:
        set_context: called with a stage's index by the thread that takes
            the baton, before it runs on (sets vLLM's forward context).
    """

    def __init__(self, set_context: Callable[[int], None]) -> None:
        self._set_context = set_context
        self._cv = threading.Condition()
        self._local = threading.local()
        self._turn = 0
        self._done: list[bool] = []

    def active(self) -> bool:
        return getattr(self._local, "index", None) is not None

    def index(self) -> int:
        index: int = self._local.index
        return index

    def yield_(self) -> None:
        me = self.index()
        with self._cv:
            self._pass_on(me)
            self._wait_turn(me)
        self._set_context(me)

    def run(self, stages: Sequence[Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
        """Run each of ``stages`` on a thread of its own, the first with the
        baton; their results in stage order. The first error a stage raised
        is raised here once every stage ended."""
        n = len(stages)
        self._done = [False] * n
        self._turn = 0
        results: list[torch.Tensor | None] = [None] * n
        errors: list[BaseException] = []
        inference = torch.is_inference_mode_enabled()  # thread-local: pass it on

        def body(i: int) -> None:
            self._local.index = i
            try:
                with self._cv:
                    self._wait_turn(i)
                self._set_context(i)
                with torch.inference_mode(inference):
                    results[i] = stages[i]()
            except BaseException as e:
                errors.append(e)
            finally:
                self._local.index = None
                with self._cv:
                    self._done[i] = True
                    self._pass_on(i)

        threads = [
            threading.Thread(target=body, args=(i,), name=f"afd-stage-{i}", daemon=True)
            for i in range(n)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return [r for r in results if r is not None]

    def _pass_on(self, me: int) -> None:
        """Give the baton to the next stage that has not ended (the caller
        holds the condition); keep it when every other stage ended."""
        n = len(self._done)
        for step in range(1, n + 1):
            nxt = (me + step) % n
            if not self._done[nxt] or nxt == me:
                self._turn = nxt
                break
        self._cv.notify_all()

    def _wait_turn(self, me: int) -> None:
        if not self._cv.wait_for(lambda: self._turn == me, BATON_TIMEOUT_S):
            raise AFDConnectorError(
                f"micro-batch stage {me} waited {BATON_TIMEOUT_S:g}s for stage "
                f"{self._turn} to hand the step back"
            )


def stage_inputs(token_slice: slice, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The model's forward arguments for the tokens of one stage."""
    out = dict(kwargs)
    for name in ("input_ids", "inputs_embeds"):
        if out.get(name) is not None:
            out[name] = out[name][token_slice]
    positions = out.get("positions")
    if positions is not None:
        out["positions"] = (
            positions[:, token_slice] if positions.ndim == 2 else positions[token_slice]
        )
    if out.get("intermediate_tensors") is not None:
        out["intermediate_tensors"] = out["intermediate_tensors"][token_slice]
    return out
