"""Unit tests for the A:F rank layout (vllm_afd.topology); no vLLM needed."""

from __future__ import annotations

import itertools

import pytest

from vllm_afd.errors import AFDConfigError
from vllm_afd.roles import AFDRole
from vllm_afd.topology import Topology, endpoint_rank

VALID = [(a, f) for a in range(1, 33) for f in range(1, a + 1)]
INVALID = [(a, f) for a in range(1, 17) for f in range(1, 17) if a < f]


# -- table tests ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "f", "ratio", "world", "name"),
    [
        (1, 1, 1, 2, "1A1F"),
        (2, 1, 2, 3, "2A1F"),
        (4, 2, 2, 6, "4A2F"),
        (6, 3, 2, 9, "6A3F"),
        (64, 16, 4, 80, "64A16F"),
        (3, 2, 2, 5, "3A2F"),
        (5, 2, 3, 7, "5A2F"),
    ],
)
def test_topology_properties_match_table(
    a: int, f: int, ratio: int, world: int, name: str
) -> None:
    topo = Topology(a, f)
    assert topo.ratio == ratio
    assert topo.world_size == world
    assert topo.name == name
    assert topo.num_ranks(AFDRole.ATTENTION) == a
    assert topo.num_ranks(AFDRole.FFN) == f


def test_topology_blocks_differ_by_at_most_one_when_f_does_not_divide_a() -> None:
    three = Topology(3, 2)
    assert [three.attention_peers(k) for k in range(2)] == [range(0, 2), range(2, 3)]
    assert [three.ffn_peer(a) for a in range(3)] == [0, 0, 1]
    five = Topology(5, 3)
    assert [len(five.attention_peers(k)) for k in range(3)] == [2, 2, 1]
    assert [five.ffn_peer(a) for a in range(5)] == [0, 0, 1, 1, 2]
    assert not five.even and Topology(4, 2).even


def test_topology_4a2f_layout_matches_table() -> None:
    topo = Topology(4, 2)
    assert [topo.role_of(g) for g in range(6)] == [
        (AFDRole.FFN, 0),
        (AFDRole.FFN, 1),
        (AFDRole.ATTENTION, 0),
        (AFDRole.ATTENTION, 1),
        (AFDRole.ATTENTION, 2),
        (AFDRole.ATTENTION, 3),
    ]
    assert topo.attention_peers(0) == range(0, 2)
    assert topo.attention_peers(1) == range(2, 4)
    assert [topo.ffn_peer(a) for a in range(4)] == [0, 0, 1, 1]
    assert topo.peers(AFDRole.FFN, 1) == (2, 3)
    assert topo.peers(AFDRole.ATTENTION, 3) == (1,)


@pytest.mark.parametrize(("a", "f"), [(0, 1), (1, 0), (-1, 1), (0, 0)])
def test_topology_rejects_non_positive_rank_counts(a: int, f: int) -> None:
    with pytest.raises(AFDConfigError, match="at least one rank per role"):
        Topology(a, f)


@pytest.mark.parametrize(("a", "f"), INVALID)
def test_topology_rejects_a_smaller_than_f(a: int, f: int) -> None:
    with pytest.raises(AFDConfigError, match="each FFN rank serves at least") as info:
        Topology(a, f)
    assert isinstance(info.value, ValueError)
    assert f"num_attention_ranks={a}" in str(info.value)
    assert f"num_ffn_ranks={f}" in str(info.value)


def test_topology_is_frozen() -> None:
    topo = Topology(2, 1)
    with pytest.raises(AttributeError):
        topo.num_attention_ranks = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    ("role", "rank"),
    [
        (AFDRole.FFN, -1),
        (AFDRole.FFN, 2),
        (AFDRole.ATTENTION, -1),
        (AFDRole.ATTENTION, 4),
    ],
)
def test_topology_global_rank_rejects_out_of_range_role_rank(
    role: AFDRole, rank: int
) -> None:
    with pytest.raises(ValueError, match=f"{role.value} rank {rank} outside"):
        Topology(4, 2).global_rank(role, rank)


@pytest.mark.parametrize("global_rank", [-1, 6, 100])
def test_topology_role_of_rejects_out_of_range_connector_rank(
    global_rank: int,
) -> None:
    with pytest.raises(ValueError, match=f"connector rank {global_rank} outside"):
        Topology(4, 2).role_of(global_rank)


def test_topology_peer_lookups_reject_out_of_range_ranks() -> None:
    topo = Topology(4, 2)
    with pytest.raises(ValueError, match="ffn rank 2 outside"):
        topo.attention_peers(2)
    with pytest.raises(ValueError, match="attention rank 4 outside"):
        topo.ffn_peer(4)


# -- property-style sweep ------------------------------------------------------


@pytest.mark.parametrize(("a", "f"), VALID)
def test_topology_invariants_hold_for_every_valid_ratio(a: int, f: int) -> None:
    topo = Topology(a, f)
    r = a // f

    # FFN ranks come first in connector order.
    assert [topo.global_rank(AFDRole.FFN, k) for k in range(f)] == list(range(f))
    assert [topo.global_rank(AFDRole.ATTENTION, i) for i in range(a)] == list(
        range(f, f + a)
    )

    # global_rank and role_of are inverse bijections over 0..A+F-1.
    seen = set()
    for role in AFDRole:
        for rank in range(topo.num_ranks(role)):
            g = topo.global_rank(role, rank)
            assert topo.role_of(g) == (role, rank)
            seen.add(g)
    assert seen == set(range(topo.world_size))
    for g in range(topo.world_size):
        assert topo.global_rank(*topo.role_of(g)) == g

    # attention_peers: contiguous ranges that tile 0..A-1 in order, of
    # length r = A / F when F divides A, else r or r + 1 (larger ones first).
    covered: list[int] = []
    sizes = [len(topo.attention_peers(k)) for k in range(f)]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1
    assert topo.even == (a % f == 0) and topo.ratio == max(sizes)
    for k in range(f):
        peers = topo.attention_peers(k)
        if a % f == 0:
            assert peers == range(k * r, (k + 1) * r)
        assert len(peers) in (r, r + 1)
        covered.extend(peers)
    assert covered == list(range(a))

    # Every attention rank is served by exactly one FFN rank, consistently.
    for i in range(a):
        servers = [k for k in range(f) if i in topo.attention_peers(k)]
        assert servers == [topo.ffn_peer(i)]
        assert topo.peers(AFDRole.ATTENTION, i) == (topo.ffn_peer(i),)
    for k in range(f):
        assert topo.peers(AFDRole.FFN, k) == tuple(topo.attention_peers(k))


# -- endpoint_rank ---------------------------------------------------------------

ENDPOINT_CASES = [
    (a, f, tp)
    for (a, f), tp in itertools.product(
        [(1, 1), (2, 1), (4, 2), (6, 3), (8, 2)], [1, 2, 4]
    )
]


@pytest.mark.parametrize(("a", "f", "tp"), ENDPOINT_CASES)
def test_endpoint_rank_is_dp_rank_on_tp0_and_none_elsewhere(
    a: int, f: int, tp: int
) -> None:
    topo = Topology(a, f)
    endpoints = []
    for dp_rank in range(a):
        for tp_rank in range(tp):
            got = endpoint_rank(
                topo, AFDRole.ATTENTION, dp_rank=dp_rank, dp_size=a, tp_rank=tp_rank
            )
            if tp_rank == 0:
                assert got == dp_rank
                endpoints.append(got)
            else:
                assert got is None
    # Exactly one endpoint per role rank: no TP group ships duplicates.
    assert endpoints == list(range(a))


@pytest.mark.parametrize(("a", "f", "tp"), ENDPOINT_CASES)
def test_endpoint_rank_of_ffn_server_is_its_afd_rank_on_tp0(
    a: int, f: int, tp: int
) -> None:
    topo = Topology(a, f)
    for rank in range(f):
        for tp_rank in range(tp):
            got = endpoint_rank(
                topo,
                AFDRole.FFN,
                dp_rank=0,
                dp_size=1,
                tp_rank=tp_rank,
                ffn_rank=rank,
            )
            assert got == (rank if tp_rank == 0 else None)


@pytest.mark.parametrize(
    ("a", "f", "dp_size", "expected"),
    [(2, 1, 1, 2), (4, 2, 8, 4)],
)
def test_endpoint_rank_rejects_attention_dp_size_mismatch_naming_key_and_flag(
    a: int, f: int, dp_size: int, expected: int
) -> None:
    with pytest.raises(AFDConfigError) as info:
        endpoint_rank(
            Topology(a, f), AFDRole.ATTENTION, dp_rank=0, dp_size=dp_size, tp_rank=0
        )
    message = str(info.value)
    assert f"afd.num_attention_ranks={expected}" in message
    assert f"data_parallel_size={dp_size}" in message
    assert f"--data-parallel-size {expected}" in message


def test_endpoint_rank_rejects_data_parallel_ffn_role() -> None:
    with pytest.raises(AFDConfigError, match=r"afd.rank=0..1") as info:
        endpoint_rank(Topology(4, 2), AFDRole.FFN, dp_rank=0, dp_size=2, tp_rank=0)
    assert "data_parallel_size=2" in str(info.value)


def test_endpoint_rank_rejects_ffn_rank_outside_topology() -> None:
    with pytest.raises(ValueError, match=r"ffn rank 2 outside 0..1"):
        endpoint_rank(
            Topology(4, 2), AFDRole.FFN, dp_rank=0, dp_size=1, tp_rank=0, ffn_rank=2
        )


@pytest.mark.parametrize("dp_rank", [-1, 2])
def test_endpoint_rank_rejects_dp_rank_outside_dp_size(dp_rank: int) -> None:
    with pytest.raises(ValueError, match=f"dp_rank {dp_rank} outside 0..1"):
        endpoint_rank(
            Topology(2, 1), AFDRole.ATTENTION, dp_rank=dp_rank, dp_size=2, tp_rank=0
        )


def test_all_to_all_pairs_every_rank_with_every_rank_any_a_and_f():
    topo = Topology(1, 3, all_to_all=True)
    assert topo.name == "1A3F" and topo.world_size == 4
    assert topo.peers(AFDRole.ATTENTION, 0) == (0, 1, 2)
    assert all(topo.peers(AFDRole.FFN, k) == (0,) for k in range(3))
    assert topo.peer_global_ranks(AFDRole.ATTENTION, 0) == (0, 1, 2)
    with pytest.raises(ValueError, match="exchanges with every FFN rank"):
        topo.ffn_peer(0)
    with pytest.raises(AFDConfigError, match="must be >= afd.num_ffn_ranks"):
        Topology(1, 3)
    assert Topology(3, 2, all_to_all=True).attention_peers(1) == range(3)
