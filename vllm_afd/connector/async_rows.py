"""The attention rank's row work for the ``async`` connector
(:mod:`vllm_afd.connector.async_ep`): which rows go to which FFN rank, the
host buffers work items and replies pass through, and the combine of the
replies.

Host work: the rows may live on a GPU; the frames leave from host memory.
The attention rank groups on the rows' device (one owner lookup, one
per-expert count, the rows each FFN rank gets, their ids and weights; in
NumPy on the CPU), then
copies only each work item into a host buffer of its FFN rank that it keeps
from one exchange to the next (pinned for a CUDA device, so the copies run
asynchronously and one wait covers them all), and adds the replies on the
device again. On the CPU a work item of every row is sent from the rows
themselves and any other is gathered straight into its buffer. Buffers are
kept because a fresh host buffer of tens of MiB costs a page fault per 4 KiB
on first touch, more than the copy into it. Replies are read into kept
buffers too, but for a CPU output that is one reply as it is (the caller
keeps it), so on the CPU an exchange allocates its output afresh and on a
device it allocates device memory only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm_afd.connector.payloads import Routing

if TYPE_CHECKING:
    from vllm_afd.connector.async_ep import ExpertSlices

#: the FFN rank that runs the shared experts (it gets every row)
SHARED_RANK = 0
#: the items an exchange sent: (FFN rank, its rows or None for all, seq)
Sent = list[tuple[int, torch.Tensor | None, int]]


@dataclass
class Group:
    """One FFN rank's share of an exchange's rows, on their device.

    Attributes:
        rank: the FFN rank.
        rows: ``[T_f]`` int64 indices of its rows, ascending; None for every
            row in order.
        ids: ``[T_f, K]`` int32 top-k of those rows, the pairs of other ranks'
            experts on this rank's first expert (their weight is 0).
        weights: ``[T_f, K]`` float32, 0 where the expert is another rank's.
        counts: pairs routed to each of the rank's experts, in expert order.
    """

    rank: int
    rows: torch.Tensor | None
    ids: torch.Tensor
    weights: torch.Tensor
    counts: tuple[int, ...]


def group_rows(
    owners: torch.Tensor,
    slices: ExpertSlices,
    routing: Routing,
    shared_experts: bool,
) -> list[Group]:
    """Which rows each FFN rank gets, with their routing there: a
    :class:`Group` per rank that gets an item, in rank order. A rank no row
    chose gets none, unless it gets every row anyway: the only rank, or rank
    0 when the model has shared experts.

    ``owners`` (:meth:`ExpertSlices.owners`) and ``routing`` on one device;
    the groups' tensors are on it too. On the CPU the grouping runs in NumPy
    (a torch operator costs several microseconds of dispatch here, NumPy's
    one, and an exchange of a few rows is mostly such overhead); on a device
    it reads from the device twice at most: the sizes, and the rows of the
    ranks that get some rows but not all.

    A pair whose expert id is out of range goes nowhere: its id becomes
    expert 0 and its weight 0, as vLLM's fused MoE skips ids outside its
    experts. Rows that carry such routing are rows no output is read from:
    the padding rows of a CUDA-graph batch and the dummy forwards that
    warm up graph capture, whose inputs are stale memory.
    """
    routing = _in_range(routing, slices.num_experts)
    if routing.topk_ids.device.type == "cpu":
        return _group_rows_host(owners, slices, routing, shared_experts)
    return _group_rows_device(owners, slices, routing, shared_experts)


def _in_range(routing: Routing, num_experts: int) -> Routing:
    """``routing`` with every pair of an out-of-range expert id on expert 0
    at weight 0 (:func:`group_rows`). On the CPU a routing without such a
    pair is returned as it is; on a device the check would cost a read from
    it, so the masks are applied always (three small kernels)."""
    ids, weights = routing.topk_ids, routing.topk_weights
    if ids.device.type == "cpu":
        a = ids.numpy()
        if not ((a < 0) | (a >= num_experts)).any():
            return routing
    bad = (ids < 0) | (ids >= num_experts)
    return Routing(
        topk_weights=weights.masked_fill(bad, 0.0),
        topk_ids=ids.masked_fill(bad, 0),
    )


def _group_rows_host(
    owners: torch.Tensor,
    slices: ExpertSlices,
    routing: Routing,
    shared_experts: bool,
) -> list[Group]:
    """:func:`group_rows` of CPU tensors, in NumPy."""
    ids = routing.topk_ids.numpy()
    weights = routing.topk_weights
    if weights.dtype != torch.float32:  # NumPy has no bfloat16
        weights = weights.float()
    w = weights.numpy()
    tokens, ranks = ids.shape[0], slices.num_ffn_ranks
    per_expert = np.bincount(ids.reshape(-1), minlength=slices.num_experts).tolist()
    if ranks == 1:  # every row, every pair its own
        ids_1 = np.ascontiguousarray(ids, dtype=np.int32)
        w_1 = np.ascontiguousarray(w)
        counts = tuple(per_expert)
        return [Group(0, None, _tensor(ids_1), _tensor(w_1), counts)]
    owner = owners.numpy()[ids]
    groups = []
    for f in range(ranks):
        mine = owner == f
        rows: np.ndarray | None = None
        if not (shared_experts and f == SHARED_RANK):
            chosen = mine.any(1)
            n = int(np.count_nonzero(chosen))
            if n == 0:
                continue
            if n < tokens:
                rows = np.flatnonzero(chosen)
        ids_f, w_f = (ids, w) if rows is None else (ids[rows], w[rows])
        if rows is not None:
            mine = mine[rows]
        lo, hi = slices.bounds(f)
        groups.append(
            Group(
                f,
                None if rows is None else _tensor(rows),
                _tensor(np.where(mine, ids_f, lo).astype(np.int32)),
                _tensor(np.where(mine, w_f, np.float32(0.0))),
                tuple(per_expert[lo:hi]),
            )
        )
    return groups


def _tensor(a: np.ndarray) -> torch.Tensor:
    """``a`` as a tensor sharing its memory; an empty one afresh (NumPy gives
    an empty result strides of 0, which a byte view of it refuses)."""
    t = torch.from_numpy(a)
    return t if a.size else torch.empty(t.shape, dtype=t.dtype)


def _group_rows_device(
    owners: torch.Tensor,
    slices: ExpertSlices,
    routing: Routing,
    shared_experts: bool,
) -> list[Group]:
    """:func:`group_rows` in torch operators, for tensors on a device."""
    ids, weights = routing.topk_ids, routing.topk_weights
    tokens = ids.shape[0]
    ranks = slices.num_ffn_ranks
    if ranks == 1:  # every row, every pair its own: one read, the counts
        per_expert = torch.bincount(
            ids.reshape(-1).long(), minlength=slices.num_experts
        )
        return [
            Group(
                0, None, ids.to(torch.int32), weights.to(torch.float32),
                tuple(per_expert.tolist()),
            )
        ]  # fmt: skip
    owner = owners[ids.long()]
    # Which ranks each row chose, and the pairs on each expert: one read
    # from the device for both (the per-rank counts are slices of the
    # per-expert ones, as each rank's pairs are the pairs on its experts).
    chose = torch.zeros(tokens, ranks, dtype=torch.bool, device=ids.device)
    chose.scatter_(1, owner, True)
    per_expert = torch.bincount(ids.reshape(-1).long(), minlength=slices.num_experts)
    sizes = torch.cat([chose.sum(0), per_expert]).tolist()
    rows_of, counts = sizes[:ranks], sizes[ranks:]
    # the rows of every rank, rank by rank, each in ascending order: read
    # once, by the first rank that gets some rows but not all
    picked: torch.Tensor | None = None
    groups = []
    at = 0
    for f in range(ranks):
        rows: torch.Tensor | None = None
        first, at = at, at + rows_of[f]
        if not (shared_experts and f == SHARED_RANK):
            if rows_of[f] == 0:
                continue
            if rows_of[f] < tokens:
                if picked is None:
                    picked = chose.t().nonzero()[:, 1]
                rows = picked[first:at]
        lo, hi = slices.bounds(f)
        mine = pick_rows(owner, rows) == f
        ids_f = torch.where(mine, pick_rows(ids, rows), lo).to(torch.int32)
        w_f = torch.where(mine, pick_rows(weights, rows), 0.0).to(torch.float32)
        groups.append(Group(f, rows, ids_f, w_f, tuple(counts[lo:hi])))
    return groups


class HostBuffers:
    """Host byte buffers kept from one exchange to the next, by name, each
    grown (by half at least) when a larger one is asked for.

    A fresh host buffer of tens of MiB costs a page fault per 4 KiB the first
    time it is written, more than the copy into it; the CUDA caching
    allocator already keeps device memory, so buffers on a device are not
    kept here.
    """

    def __init__(self) -> None:
        #: name -> (buffer, pinned)
        self._bufs: dict[str, tuple[torch.Tensor, bool]] = {}

    def take(self, name: str, nbytes: int, pinned: bool = False) -> torch.Tensor:
        """``[nbytes]`` uint8 of buffer ``name`` (pinned: page-locked, for
        asynchronous copies from a CUDA device); its contents are whatever
        the last user left."""
        buf, was_pinned = self._bufs.get(name, (None, pinned))
        if buf is None or buf.numel() < nbytes or was_pinned != pinned:
            size = nbytes if buf is None else max(nbytes, buf.numel() * 3 // 2)
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
            self._bufs[name] = buf, pinned
        return buf[:nbytes]

    def scratch(
        self,
        name: str,
        shape: tuple[int, int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """An uninitialised ``shape`` tensor on ``device``: a view of buffer
        ``name`` on the CPU, a fresh tensor on any other device."""
        if device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        return view_bytes(
            self.take(name, shape[0] * shape[1] * dtype.itemsize), 0, dtype, shape
        )


def view_bytes(
    buf: torch.Tensor, at: int, dtype: torch.dtype, shape: tuple[int, int]
) -> torch.Tensor:
    """``buf[at:]`` (uint8) as a ``shape`` tensor of ``dtype``."""
    return buf[at : at + shape[0] * shape[1] * dtype.itemsize].view(dtype).view(shape)


def pick_rows(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return t if rows is None else t.index_select(0, rows)


def combine(
    hidden: torch.Tensor,
    sent: Sent,
    replies: dict[int, torch.Tensor],
    parts: int,
    buffers: HostBuffers,
) -> torch.Tensor:
    """``[T, parts * H]`` on ``hidden``'s device from the (host) replies: the
    routed parts added in rank order in float32 and rounded once; the shared
    part from its rank."""
    device = hidden.device
    if reply_is_output(sent):
        return replies[sent[0][0]].to(device)
    tokens, width = hidden.shape
    out = hidden.new_empty((tokens, parts * width))
    in_place = hidden.dtype == torch.float32  # rounding to it is no rounding
    if in_place:
        routed = out[:, (parts - 1) * width :]
    else:
        routed = buffers.scratch("routed", (tokens, width), torch.float32, device)
    # from zeros, not a copy of the first part: 0.0 + -0.0 is 0.0
    routed.zero_()
    for f, rows, _ in sent:
        reply = replies[f].to(device)
        part = reply[:, (parts - 1) * width :]
        if rows is None:
            routed += part  # in float32 (type promotion), as part.float() would
        else:
            if part.dtype != torch.float32:  # index_add_ wants one dtype
                shape = (part.shape[0], part.shape[1])
                wide = buffers.scratch("part", shape, torch.float32, device)
                part = wide.copy_(part)
            routed.index_add_(0, rows, part)
        if parts == 2 and f == SHARED_RANK:
            out[:, :width] = reply[:, :width]  # rank 0 had every row
    if not in_place:
        out[:, (parts - 1) * width :] = routed
    return out


def reply_is_output(sent: Sent) -> bool:
    """Whether the exchange's output is its one reply as it is (one rank
    had every row)."""
    return len(sent) == 1 and sent[0][1] is None
