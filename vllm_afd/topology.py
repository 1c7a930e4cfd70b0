"""Who talks to whom: the A:F rank layout, shared by both roles.

Connector rank order puts FFN ranks first::

    connector rank:   0 .. F-1          F .. F+A-1
    role rank:        ffn 0 .. F-1      attention 0 .. A-1

    q, m = divmod(A, F)            blocks differ by at most one rank:
    ffn k  <-->  attention [start(k), start(k+1)),  start(k) = k*q + min(k, m)

(the first ``m`` FFN ranks serve ``q + 1`` attention ranks, the others ``q``;
with A a multiple of F every block is ``A / F`` ranks: ``[k*r, (k+1)*r)``).

All to all (the ``async`` connector): every attention rank exchanges with
every FFN rank, which each hold a slice of the experts; any A and F::

    ffn k  <-->  attention [0, A)          attention a  <-->  ffn [0, F)

An *endpoint* is one connector member. Attention ranks are the vLLM
data-parallel ranks of the attention deployment (vLLM keeps them in
lockstep, idle ranks run dummy steps, so an FFN rank can merge its peers'
tokens every step). FFN ranks are independent ``vllm serve`` processes, each
with ``afd.rank``. Only tensor-parallel rank 0 of a rank joins the connector
(the other TP ranks get what it receives through vLLM's TP group), so a TP
group never ships duplicate activations.

Pure functions only; no torch, no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_afd.errors import AFDConfigError
from vllm_afd.roles import AFDRole


@dataclass(frozen=True)
class Topology:
    """The A:F layout of one deployment."""

    num_attention_ranks: int
    num_ffn_ranks: int
    all_to_all: bool = False

    def __post_init__(self) -> None:
        a, f = self.num_attention_ranks, self.num_ffn_ranks
        if a < 1 or f < 1:
            raise AFDConfigError(
                f"topology needs at least one rank per role, got {a}A{f}F"
            )
        if a < f and not self.all_to_all:
            raise AFDConfigError(
                f"afd.num_attention_ranks={a} must be >= afd.num_ffn_ranks={f}; "
                "each FFN rank serves at least one attention rank"
            )

    @property
    def ratio(self) -> int:
        """The most attention ranks one FFN rank serves (``ceil(A / F)``;
        ``A / F`` when F divides A)."""
        return -(-self.num_attention_ranks // self.num_ffn_ranks)

    @property
    def even(self) -> bool:
        """Every FFN rank serves as many attention ranks (F divides A)."""
        return self.num_attention_ranks % self.num_ffn_ranks == 0

    def _start(self, ffn_rank: int) -> int:
        q, m = divmod(self.num_attention_ranks, self.num_ffn_ranks)
        return ffn_rank * q + min(ffn_rank, m)

    @property
    def world_size(self) -> int:
        return self.num_attention_ranks + self.num_ffn_ranks

    @property
    def name(self) -> str:
        return f"{self.num_attention_ranks}A{self.num_ffn_ranks}F"

    def num_ranks(self, role: AFDRole) -> int:
        if role is AFDRole.ATTENTION:
            return self.num_attention_ranks
        return self.num_ffn_ranks

    def global_rank(self, role: AFDRole, role_rank: int) -> int:
        """Connector rank of ``role_rank`` in ``role`` (FFN ranks first)."""
        self._check_role_rank(role, role_rank)
        if role is AFDRole.FFN:
            return role_rank
        return self.num_ffn_ranks + role_rank

    def role_of(self, global_rank: int) -> tuple[AFDRole, int]:
        """Inverse of :meth:`global_rank`."""
        if not 0 <= global_rank < self.world_size:
            raise ValueError(
                f"connector rank {global_rank} outside 0..{self.world_size - 1}"
            )
        if global_rank < self.num_ffn_ranks:
            return AFDRole.FFN, global_rank
        return AFDRole.ATTENTION, global_rank - self.num_ffn_ranks

    def attention_peers(self, ffn_rank: int) -> range:
        """Attention role ranks served by ``ffn_rank``, in merge order."""
        self._check_role_rank(AFDRole.FFN, ffn_rank)
        if self.all_to_all:
            return range(self.num_attention_ranks)
        return range(self._start(ffn_rank), self._start(ffn_rank + 1))

    def ffn_peers(self, attention_rank: int) -> tuple[int, ...]:
        """The FFN role ranks ``attention_rank`` exchanges with."""
        if self.all_to_all:
            self._check_role_rank(AFDRole.ATTENTION, attention_rank)
            return tuple(range(self.num_ffn_ranks))
        return (self.ffn_peer(attention_rank),)

    def ffn_peer(self, attention_rank: int) -> int:
        """The FFN role rank that serves ``attention_rank`` (blocks only)."""
        if self.all_to_all:
            raise ValueError(
                "all-to-all topology: an attention rank exchanges with every "
                "FFN rank (ffn_peers)"
            )
        self._check_role_rank(AFDRole.ATTENTION, attention_rank)
        q, m = divmod(self.num_attention_ranks, self.num_ffn_ranks)
        big = m * (q + 1)  # the ranks of the first m (larger) blocks
        if attention_rank < big:
            return attention_rank // (q + 1)
        return m + (attention_rank - big) // q

    def peers(self, role: AFDRole, role_rank: int) -> tuple[int, ...]:
        """Role ranks of the other role this endpoint exchanges with."""
        if role is AFDRole.FFN:
            return tuple(self.attention_peers(role_rank))
        return self.ffn_peers(role_rank)

    def peer_global_ranks(self, role: AFDRole, role_rank: int) -> tuple[int, ...]:
        """Connector ranks of :meth:`peers`, in the same order."""
        other = AFDRole.FFN if role is AFDRole.ATTENTION else AFDRole.ATTENTION
        return tuple(self.global_rank(other, p) for p in self.peers(role, role_rank))

    def _check_role_rank(self, role: AFDRole, role_rank: int) -> None:
        n = self.num_ranks(role)
        if not 0 <= role_rank < n:
            raise ValueError(f"{role.value} rank {role_rank} outside 0..{n - 1}")


def endpoint_rank(
    topology: Topology,
    role: AFDRole,
    *,
    dp_rank: int,
    dp_size: int,
    tp_rank: int,
    ffn_rank: int | None = None,
) -> int | None:
    """Role rank of a vLLM worker process, or None if it does not join.

    Args:
        topology: the deployment layout.
        role: this process's role.
        dp_rank: vLLM data-parallel rank of the process.
        dp_size: vLLM data-parallel size of this role's deployment.
        tp_rank: vLLM tensor-parallel rank within its DP rank.
        ffn_rank: ``afd.rank`` of an FFN server (None means 0).

    Returns:
        The role rank for TP rank 0 (the endpoint), None for other TP ranks.

    Raises:
        AFDConfigError: the DP size does not fit the role's rank count.
    """
    if role is AFDRole.FFN:
        if dp_size != 1:
            raise AFDConfigError(
                f"the FFN role runs data_parallel_size={dp_size}; FFN ranks must "
                "be independent: run one vllm serve per FFN rank (data-parallel "
                f"size 1) with afd.rank=0..{topology.num_ffn_ranks - 1}"
            )
        rank = ffn_rank or 0
        topology._check_role_rank(role, rank)
        return rank if tp_rank == 0 else None
    expected = topology.num_ranks(role)
    if dp_size != expected:
        key = "num_attention_ranks" if role is AFDRole.ATTENTION else "num_ffn_ranks"
        raise AFDConfigError(
            f"afd.{key}={expected} but the {role.value} role runs "
            f"data_parallel_size={dp_size}; each data-parallel rank is one "
            f"{role.value} rank, so set --data-parallel-size {expected}"
        )
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} outside 0..{dp_size - 1}")
    return dp_rank if tp_rank == 0 else None
