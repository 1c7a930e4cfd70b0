"""A vote of the attention role's data-parallel ranks in every forward.

vLLM coordinates its data-parallel ranks once per forward with one
all-reduce of a small int32 table (``[rows, dp_size]``, each rank filling its
column: tokens, CUDA graph mode, ...), in
vllm/v1/worker/dp_utils.py:_run_ar (V1 model runner) and in
vllm/v1/worker/gpu/dp_utils.py:sync_cudagraph_and_dp_padding (V2) @ 0.32.0.
The FFN links of the attention ranks need one decision that every rank reads the same:
whether all of them are ready to exchange again after a rejoin
(``worker.ffn_link``). These patches hand both modules a ``torch.distributed``
whose ``all_reduce`` of such a table carries one more row: this rank's vote
(``1`` or ``0``, summed over the ranks). The table vLLM reads is unchanged,
and no collective is added: the vote rides on the one vLLM runs anyway.
Installed in attention worker processes with data parallelism.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch
import torch.distributed as dist

from vllm_afd.compat.patching import Patch, apply_patch

_REASON = "carry the FFN links' ready vote in vLLM's per-forward DP all-reduce"
_REMOVAL = "when vLLM lets a plugin add to its per-forward DP coordination"
V1_DIST = Patch(
    target="vllm.v1.worker.dp_utils:dist",
    expected_params=None,
    reason=_REASON,
    removal=_REMOVAL,
)
V2_DIST = Patch(
    target="vllm.v1.worker.gpu.dp_utils:dist",
    expected_params=None,
    reason=_REASON,
    removal=_REMOVAL,
)


class Voter(Protocol):
    """What votes: an attention rank's FFN link (``worker.ffn_link``)."""

    def vote(self) -> bool: ...

    def decided(self, all_ready: bool) -> None: ...


_voter: Voter | None = None
_lock = threading.Lock()


class VotingDist:
    """``torch.distributed`` for vLLM's DP coordination: a 2-D int32 SUM
    all-reduce carries the voter's row; everything else passes through."""

    def __init__(self, module: Any) -> None:
        self._dist = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dist, name)

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: Any = dist.ReduceOp.SUM,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        voter = _voter
        if (
            voter is None
            or async_op
            or op != dist.ReduceOp.SUM
            or tensor.dim() != 2
            or tensor.dtype != torch.int32
        ):
            return self._dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
        row = torch.zeros((1, tensor.shape[1]), dtype=tensor.dtype)
        row[0, 0] = int(voter.vote())
        table = torch.cat([tensor, row.to(tensor.device)])
        self._dist.all_reduce(table, op=op, group=group)
        tensor.copy_(table[:-1])
        ready = int(table[-1, 0].item())
        voter.decided(ready == self._dist.get_world_size(group))
        return None


def install(voter: Voter) -> None:
    """Vote with ``voter`` in this process's DP coordination from now on."""
    global _voter
    with _lock:
        _voter = voter
        for patch in (V1_DIST, V2_DIST):
            apply_patch(patch, VotingDist)


def uninstall() -> None:
    """Stop voting (the link closed); the patched modules pass through."""
    global _voter
    with _lock:
        _voter = None
