"""The cuda_ipc data plane: buffer plan, setup records and pair checks (CPU),
and real endpoints on one or more GPUs (``gpu`` marker)."""

from __future__ import annotations

import os
import queue
import sys
import threading

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _scenarios as S  # noqa: E402

from vllm_afd.connector import ipc_layout as L  # noqa: E402
from vllm_afd.connector import p2p_rendezvous  # noqa: E402
from vllm_afd.connector.control import ControlPlane  # noqa: E402
from vllm_afd.connector.data import check_backend  # noqa: E402
from vllm_afd.connector.p2p import resolve_backend  # noqa: E402
from vllm_afd.connector.p2p_control import P2PControlPlane  # noqa: E402
from vllm_afd.connector.protocol import Kind  # noqa: E402
from vllm_afd.errors import (  # noqa: E402
    AFDConfigError,
    AFDProtocolError,
)
from vllm_afd.roles import AFDRole  # noqa: E402
from vllm_afd.topology import Topology  # noqa: E402

SHAPES = L.Shapes(
    max_tokens=100, ubatches=2, hidden=64, itemsize=2, top_k=4, gate=True,
    moe_output_parts=2,
)  # fmt: skip


# ------------------------------------------------------------------ CPU
def test_pair_layout_holds_every_slot_aligned_without_overlap():
    lay = L.pair_layout(SHAPES)
    kinds = {(r.kind, r.ubatch) for r in lay.regions}
    assert kinds == {(k, u) for k in Kind for u in (0, 1)}
    spans = sorted((r.offset, r.offset + r.nbytes) for r in lay.regions)
    assert spans[0][0] >= lay.num_slots * L.FLAG_BYTES  # flags come first
    assert all(a_end <= b for (_, a_end), (b, _) in zip(spans, spans[1:], strict=False))
    assert all(r.offset % L.ALIGN == 0 for r in lay.regions)
    hidden = lay.region(Kind.A2F_HIDDEN, 1)
    assert hidden.nbytes == 100 * 64 * 2 and hidden.slot == 4
    assert lay.region(Kind.A2F_TOPK_IDS, 0).nbytes == 100 * 4 * 4
    assert lay.region(Kind.F2A, 0).nbytes == 100 * 64 * 2 * 2  # output parts
    assert lay.nbytes >= spans[-1][1]


def test_pair_layout_without_gate_has_no_routing_regions():
    lay = L.pair_layout(L.Shapes(10, 1, 8, 4, 2, False))
    assert [r.kind for r in lay.regions] == [Kind.A2F_HIDDEN, Kind.F2A]
    with pytest.raises(AFDProtocolError, match="no cuda_ipc buffer for a2f_topk_ids"):
        lay.region(Kind.A2F_TOPK_IDS, 0)


def test_setup_records_round_trip_through_the_wire():
    place = L.Place("h/boot", "GPU-1", True)
    offer = L.Offer(SHAPES, place, {"handle": "00ff", "nbytes": 3})
    assert L.Offer.from_wire(offer.to_wire()) == offer
    answer = L.Answer(place)
    assert L.Answer.from_wire(answer.to_wire()) == answer
    with pytest.raises(AFDProtocolError, match="unreadable cuda_ipc setup record"):
        L.Offer.from_wire({"backend": "cuda_ipc"})


@pytest.mark.parametrize(
    ("mine", "theirs", "slicing", "match"),
    [
        (
            ("a/1", "G0", True),
            ("b/2", "G0", True),
            False,
            "needs both ends on one host",
        ),
        (("a/1", "G0", False), ("a/1", "G0", False), False, "without MPS"),
        (("a/1", "G0", True), ("a/1", "G0", False), False, "nvidia-cuda-mps-control"),
        (("a/1", "G0", False), ("a/1", "G0", False), True, None),
        (("a/1", "G0", True), ("a/1", "G0", True), False, None),
        (("a/1", "G0", False), ("a/1", "G1", False), False, None),
    ],
    ids=["two-hosts", "one-gpu-no-mps", "one-side-mps", "forced", "mps", "two-gpus"],
)
def test_check_pair_refuses_what_cannot_work(mine, theirs, slicing, match):
    args = (L.Place(*mine), L.Place(*theirs), "the pair", slicing)
    if match is None:
        L.check_pair(*args)
    else:
        with pytest.raises(AFDConfigError, match=match):
            L.check_pair(*args)


def test_check_shapes_names_the_differing_dims():
    L.check_shapes(SHAPES, L.Shapes(7, 1, 64, 2, 4, True, 2), "peer")
    with pytest.raises(AFDProtocolError, match="differ in hidden, gate"):
        L.check_shapes(SHAPES, L.Shapes(7, 1, 32, 2, 4, False, 2), "peer")
    with pytest.raises(AFDProtocolError, match="max_tokens=0"):
        L.check_shapes(SHAPES, L.Shapes(0, 1, 64, 2, 4, True, 2), "peer")


def test_mps_is_seen_by_its_control_pipe(tmp_path):
    assert not L.mps_active({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    (tmp_path / "control").touch()
    assert L.mps_active({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})


@pytest.mark.parametrize(
    ("backend", "device", "want"),
    [
        ("auto", "cpu", "gloo"),
        ("auto", "cuda", "nccl"),
        ("nccl", "cuda", "nccl"),
        ("cuda_ipc", "cuda", "cuda_ipc"),
    ],
)
def test_backend_resolution(backend, device, want):
    assert resolve_backend(backend, torch.device(device)) == want


def test_cuda_ipc_backend_refuses_cpu_tensors():
    with pytest.raises(AFDConfigError, match="backend='cuda_ipc' moves cuda tensors"):
        resolve_backend("cuda_ipc", torch.device("cpu"))


def test_check_backend_names_both_backends():
    check_backend("nccl", {"backend": "nccl"})
    with pytest.raises(AFDProtocolError, match="'cuda_ipc', the FFN rank's is 'nccl'"):
        check_backend("nccl", {"backend": "cuda_ipc"})


def _plane(role: AFDRole, port: int) -> ControlPlane:
    return P2PControlPlane(
        host="127.0.0.1", port=port, topology=Topology(1, 1), role=role,
        role_rank=0, timeout_s=5, connect_timeout_s=10,
    )  # fmt: skip


def _ffn_setup(peer, theirs):
    check_backend("gloo", theirs)
    return {"backend": "gloo", "answer": peer}


def _swap_once(fp, att_backend: str, ok: bool) -> None:
    port = S.free_port()
    got: queue.Queue = queue.Queue()

    def serve() -> None:
        plane = _plane(AFDRole.FFN, port)
        try:
            got.put(plane.start(fp, _ffn_setup))
        except AFDProtocolError as e:
            got.put(e)
        finally:
            plane.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    att = _plane(AFDRole.ATTENTION, port)
    offer = {"backend": att_backend}
    try:
        if ok:
            rv = att.start(fp, lambda peer, theirs: offer)
            assert rv.peer_blobs == ({"backend": "gloo", "answer": 0},)
            assert got.get(timeout=10).peer_blobs == ({"backend": "gloo"},)
        else:
            with pytest.raises(AFDProtocolError, match="set the same afd"):
                att.start(fp, lambda peer, theirs: offer)
            assert "set the same afd" in str(got.get(timeout=10))
    finally:
        att.close()
        t.join(10)


def test_setup_swap_carries_records_and_rejects_a_backend_mismatch():
    """Real control planes: SETUP records reach the other side; a backend the
    FFN side refuses fails both sides with the same message."""
    fp = S.fingerprint(S.Scenario("p2p", 0, 1, 1), "ffn", 0)
    for att_backend, ok in (("gloo", True), ("nccl", False)):
        _swap_once(fp, att_backend, ok)
    assert p2p_rendezvous.swap_setup  # the swap lives with the handshake


# ------------------------------------------------------------------ GPU
def _gpu_options(copy: str = "ce") -> dict:
    """cuda_ipc, and time slicing allowed when no MPS daemon serves this GPU
    (every exchange is slow then, but correct)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return {
        "backend": "cuda_ipc",
        "allow_time_slicing": not L.mps_active(),
        "ipc_copy": copy,
    }


@pytest.mark.gpu
@pytest.mark.parametrize("copy", ["ce", "sm"])
@pytest.mark.parametrize("gate", [False, True], ids=["ffn-gate", "attention-gate"])
@pytest.mark.parametrize(
    "topo", [(1, 1), (2, 1), (2, 2)], ids=lambda t: f"{t[0]}A{t[1]}F"
)
def test_cuda_ipc_round_trip_exact(topo, gate, copy):
    """Every endpoint on the GPUs there are (one is enough), eager."""
    a, f = topo
    sc = S.Scenario(
        "p2p", S.free_port(), a, f, num_ubatches=2, dtype="bfloat16", hidden=256,
        device="cuda", gate_on_attention=gate, options=_gpu_options(copy),
    )  # fmt: skip
    results = S.run(sc, limit_s=180)
    bad = {ep: r for ep, r in results.items() if not r.get("ok")}
    assert not bad, bad


def _run_programs(name: str, sc: S.Scenario, limit_s: float = 120) -> dict:
    """Every endpoint of ``sc`` running program ``name`` in its own process;
    their outcomes by (role, rank)."""
    import _ipc_programs

    eps = [(name, role, rank, sc) for role, rank in S.endpoints(sc)]
    return S.run_processes(_ipc_programs.main, eps, limit_s)


def _run_pair(name: str, sc: S.Scenario, limit_s: float = 120) -> dict:
    """One attention and one FFN endpoint; their outcomes by role."""
    return {role: r for (role, _), r in _run_programs(name, sc, limit_s).items()}


@pytest.mark.gpu
@pytest.mark.parametrize("copy", ["ce", "sm"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_cuda_ipc_attention_ranks_sharing_an_ffn_rank_replay_graphs_for_long(
    ranks, copy
):
    """kA1F on one GPU, every endpoint a process (under MPS, as ``vllm-afd
    plan`` runs it): each attention rank replays its graph of 3 round trips
    1000 times, the FFN rank its graph of the merged step, with a matmul per
    layer filling the SMs while the peers' waits spin. Every reply exact,
    no wait runs out."""
    sc = S.Scenario(
        "p2p", S.free_port(), ranks, 1, dtype="bfloat16", hidden=512,
        device="cuda", options=_gpu_options(copy),
    )  # fmt: skip
    out = _run_programs("many", sc, limit_s=240)
    bad = {ep: r for ep, r in out.items() if not r.get("ok")}
    assert not bad, bad
    assert out[("ffn", 0)]["replays"] == 1000, out


@pytest.mark.gpu
@pytest.mark.parametrize("copy", ["ce", "sm"])
def test_cuda_ipc_exchanges_replay_from_cuda_graphs(copy):
    sc = S.Scenario(
        "p2p", S.free_port(), 1, 1, dtype="bfloat16", hidden=512, device="cuda",
        options=_gpu_options(copy),
    )  # fmt: skip
    out = _run_pair("graph", sc)
    assert out["attention"].get("ok"), out
    assert out["ffn"].get("ok") and out["ffn"]["replays"] == 5, out


@pytest.mark.gpu
@pytest.mark.parametrize("copy", ["ce", "sm"])
def test_cuda_ipc_graphs_keep_replaying_across_an_ffn_restart(copy):
    """The attention rank owns the buffers its graph points at: an FFN that
    dies mid-replay fails that step (aborted), and a new FFN process serves
    the same graph's later replays exactly, after resume()."""
    sc = S.Scenario(
        "p2p", S.free_port(), 1, 1, dtype="bfloat16", hidden=512, device="cuda",
        timeout_s=20.0, options=_gpu_options(copy),
    )  # fmt: skip
    out = _run_pair("rejoin", sc, limit_s=240)
    att = out["attention"]
    assert att.get("ok"), out
    assert "aborted" in att["error"] or "failed an exchange" in att["error"], att
    assert att["ended_s"] < 15, att  # the abort, not the device timeout
    assert out["ffn"].get("ok") and out["ffn"]["served"] == att["replays"], out


@pytest.mark.gpu
def test_cuda_ipc_desynchronised_exchange_is_an_error_on_both_sides():
    sc = S.Scenario(
        "p2p", S.free_port(), 1, 1, dtype="bfloat16", hidden=64, device="cuda",
        options=_gpu_options(),
    )  # fmt: skip
    out = _run_pair("desync", sc)
    assert out["ffn"].get("ok"), out
    assert out["ffn"]["error"] == "AFDProtocolError", out
    assert "desynchronised" in out["ffn"]["message"], out
    assert out["attention"].get("ok"), out
    assert "failed an exchange" in out["attention"]["message"], out


@pytest.mark.gpu
def test_cuda_ipc_wait_for_a_silent_peer_ends_after_timeout_s():
    sc = S.Scenario(
        "p2p", S.free_port(), 1, 1, dtype="bfloat16", hidden=64, device="cuda",
        timeout_s=2.0, options=_gpu_options(),
    )  # fmt: skip
    out = _run_pair("timeout", sc)
    att = out["attention"]
    assert att.get("ok") and att["error"] == "AFDTimeoutError", out
    assert "the slot held no exchange yet" in att["message"], att
    assert 1.5 < att["waited"] < 10, att


def _nccl_plane(gpu: str):
    from vllm_afd.connector.p2p_data import P2PDataPlane

    return P2PDataPlane(
        host="127.0.0.1", store_port=1, global_rank=0, world_size=2,
        backend="nccl", timeout_s=1, connect_timeout_s=1, gpu=gpu,
    )  # fmt: skip


def test_nccl_setup_refuses_two_roles_on_one_gpu_naming_cuda_ipc():
    attention, ffn = _nccl_plane("GPU-a"), _nccl_plane("GPU-a")
    offer = attention.setup(0, None)
    assert offer == {"backend": "nccl", "gpu": "GPU-a"}
    with pytest.raises(AFDConfigError, match="set afd.connector_extra_config.backend"):
        ffn.setup(0, offer)
    assert _nccl_plane("GPU-b").setup(0, offer) == {"backend": "nccl", "gpu": "GPU-b"}
