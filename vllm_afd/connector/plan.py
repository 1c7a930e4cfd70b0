"""The FFN view of a step: the plans of its attention peers merged.

Dimensions: T tokens of one peer in one ubatch, ΣT merged over peers, U ubatches.

FFN rank k serves attention ranks ``[k*r, (k+1)*r)``. For each ubatch the
tokens of those peers are concatenated in peer order::

    ubatch u:  | peer k*r (T0) | peer k*r+1 (T1) | ... |   ΣT = T0 + T1 + ...
               0               T0                T0+T1

A peer with zero tokens occupies an empty slice and exchanges nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_afd.connector.protocol import ExecMode, StepPlan, ubatches
from vllm_afd.errors import AFDProtocolError


@dataclass(frozen=True)
class MergedPlan:
    """One step as seen by an FFN rank (local record, plain ints).

    Attributes:
        step_id: the step, identical on every peer.
        mode: execution mode, identical on every peer.
        peers: attention role ranks in merge order.
        peer_tokens: ``[P][U]`` tokens per peer per ubatch.
        ubatch_tokens: ``[U]`` ΣT per ubatch (the FFN batch sizes).
        offsets: ``[P][U]`` first row of each peer's slice in its ubatch.
    """

    step_id: int
    mode: ExecMode
    peers: tuple[int, ...]
    peer_tokens: tuple[tuple[int, ...], ...]
    ubatch_tokens: tuple[int, ...]
    offsets: tuple[tuple[int, ...], ...]

    @property
    def num_ubatches(self) -> int:
        return len(self.ubatch_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.ubatch_tokens)


def _same_mode(a: ExecMode, b: ExecMode) -> bool:
    loose = (ExecMode.EAGER, ExecMode.WARMUP)
    return a == b or (a in loose and b in loose)


def _padded(plan: StepPlan, num_ubatches: int) -> tuple[int, ...] | None:
    if len(plan.ubatch_tokens) == num_ubatches:
        return plan.ubatch_tokens
    if plan.num_tokens == 0:
        return (0,) * num_ubatches
    return None


def merge_plans(peers: tuple[int, ...], plans: list[StepPlan]) -> MergedPlan:
    """Merge the plans of ``peers`` (same order) into one FFN step.

    A peer with no tokens may send fewer ubatches (or none); every other peer
    must agree on the step, the mode and the number of ubatches. EAGER and
    WARMUP may mix (an idle data-parallel rank runs a dummy forward while
    another serves; the merged step is WARMUP); graph modes must agree.

    Raises:
        AFDProtocolError: the peers disagree; the message names them.
    """
    assert len(peers) == len(plans) and plans
    first = plans[0]
    for rank, plan in zip(peers, plans, strict=True):
        if plan.step_id != first.step_id or not _same_mode(plan.mode, first.mode):
            raise AFDProtocolError(
                f"attention ranks disagree on the step: rank {peers[0]} sent step "
                f"{first.step_id} ({first.mode.name}), rank {rank} sent step "
                f"{plan.step_id} ({plan.mode.name})"
            )
    num_ubatches = max(len(p.ubatch_tokens) for p in plans)
    tokens: list[tuple[int, ...]] = []
    for rank, plan in zip(peers, plans, strict=True):
        padded = _padded(plan, num_ubatches)
        if padded is None:
            raise AFDProtocolError(
                f"attention rank {rank} planned {ubatches(len(plan.ubatch_tokens))} "
                f"in step {plan.step_id}, other peers {num_ubatches}; ranks with "
                "tokens must use the same ubatch count"
            )
        tokens.append(padded)
    totals = tuple(sum(t[u] for t in tokens) for u in range(num_ubatches))
    offsets: list[tuple[int, ...]] = []
    running = [0] * num_ubatches
    for t in tokens:
        offsets.append(tuple(running))
        running = [a + b for a, b in zip(running, t, strict=True)]
    modes = {p.mode for p in plans}
    return MergedPlan(
        step_id=first.step_id,
        mode=ExecMode.WARMUP if ExecMode.WARMUP in modes else first.mode,
        peers=tuple(peers),
        peer_tokens=tuple(tokens),
        ubatch_tokens=totals,
        offsets=tuple(offsets),
    )
