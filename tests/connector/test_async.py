"""The ``async`` connector over real TCP connections: work items, expert
slices, combine, shutdown, a killed and a silent FFN rank, refusals.

Endpoints run as threads of this process (a killed FFN rank as a process of
its own) and rendezvous on a free loopback port. Each FFN rank computes its
experts with a stand-in expert ``e(x) = (e + 1) * x + e``; every attention
rank checks each layer's output against the sum over all its rows' experts.
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import signal
import threading
import time
from typing import Any

import pytest
import torch
from _scenarios import free_port

from vllm_afd.config import parse_afd_config
from vllm_afd.connector import Fingerprint, Routing, async_ep, async_rows, async_slots
from vllm_afd.connector.async_ep import AsyncAttention, AsyncFFN, ExpertSlices
from vllm_afd.connector.async_wire import FrameKind, FrameReader, encode_header
from vllm_afd.connector.factory import (
    ExchangeLimits,
    create_async_endpoint,
    create_connector,
)
from vllm_afd.errors import (
    AFDConfigError,
    AFDPeerError,
    AFDProtocolError,
    AFDTimeoutError,
)

H, K, E = 16, 2, 8
LAYERS, STEPS = (1, 3), 3


def _fp(a: int, f: int, top_k: int = K, parts: int = 1) -> Fingerprint:
    return Fingerprint(
        arch="TinyMoE", hidden_size=H, dtype="float32", num_layers=4,
        moe_layers=LAYERS, num_experts=E, top_k=top_k, num_attention_ranks=a,
        num_ffn_ranks=f, compute_gate_on_attention=True, connector="async",
        moe_output_parts=parts, remote_layers=LAYERS,
    )  # fmt: skip


def _config(role: str, a: int, f: int, port: int, rank: int = 0, **extra: Any):
    raw: dict[str, Any] = {
        "role": role, "connector": "async", "port": port,
        "num_attention_ranks": a, "num_ffn_ranks": f,
        "connector_extra_config": {"timeout_s": 10.0, "connect_timeout_s": 30.0,
                                   **extra},
    }  # fmt: skip
    if role == "ffn":
        raw["rank"] = rank
    return parse_afd_config(raw)


def _endpoint(role: str, a: int, f: int, port: int, rank: int, **kw: Any):
    fp_kw = {k: kw.pop(k) for k in ("top_k", "parts") if k in kw}
    limits = kw.pop("limits", None)
    device = kw.pop("device", None)
    config = _config(role, a, f, port, rank, **kw)
    return create_async_endpoint(config, rank, _fp(a, f, **fp_kw), limits, device)


def _expert_sum(hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Σ_k w_k * ((id_k + 1) * x + id_k), in float32, in k order."""
    out = torch.zeros_like(hidden, dtype=torch.float32)
    ids = routing.topk_ids.long()
    for k in range(ids.shape[1]):
        e = ids[:, k : k + 1].float()
        out += routing.topk_weights[:, k : k + 1] * ((e + 1) * hidden.float() + e)
    return out.to(hidden.dtype)


def _shared(hidden: torch.Tensor) -> torch.Tensor:
    return 0.5 * hidden


def _serve(ep: AsyncFFN, parts: int, seen: list, stop_after: int | None = None):
    ep.start()
    n = 0
    while (item := ep.next_item()) is not None:
        n += 1
        seen.append(
            (item.source, item.layer, item.hidden.shape[0], item.counts, item.in_slot)
        )
        routed = _expert_sum(item.hidden, item.routing)
        out = routed if parts == 1 else torch.cat([_shared(item.hidden), routed], 1)
        ep.reply(item, out)
        if stop_after is not None and n >= stop_after:
            ep.close("stop for the test")
            return


def _inputs(rank: int, step: int, layer: int, tokens: int, only: int | None = None):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + layer)
    hidden = torch.randn(tokens, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    if only is not None:  # every row on the experts of FFN rank `only` of 2
        ids = ids % (E // 2) + only * (E // 2)
        ids[:, 1] = ids[:, 0] + 1 - 2 * (ids[:, 0] % 2)  # a distinct expert
    weights = torch.rand(tokens, K, generator=g)
    return hidden, Routing(weights, ids.to(torch.int32))


def _drive(
    ep: AsyncAttention, rank: int, parts: int, shared: bool, only=None, device=None
):
    ep.start()
    worst = 0.0
    for step in range(STEPS):
        ep.note_step()
        tokens = 3 + 2 * step + rank
        for layer in LAYERS:
            hidden, routing = _inputs(rank, step, layer, tokens, only)
            if device is not None:
                hidden, routing = hidden.to(device), routing.to(device)
            out = ep.exchange(layer, hidden, routing, parts, shared, 10.0)
            want = _expert_sum(hidden, routing)
            if parts == 2:
                want = torch.cat([_shared(hidden), want], 1)
            assert out.shape == want.shape
            worst = max(worst, float((out - want).abs().max()))
    ep.close()
    return worst


def _run(
    a: int,
    f: int,
    parts: int = 1,
    shared: bool = False,
    only=None,
    payload: str = "socket",
    limits: ExchangeLimits | None = None,
):
    port = free_port()
    seen: dict[int, list] = {r: [] for r in range(f)}
    results: dict[str, Any] = {}

    def guard(name: str, fn, *args):
        try:
            results[name] = fn(*args)
        except BaseException as e:  # reported by the test
            results[name] = e

    kw = {"parts": parts, "payload": payload, "limits": limits}
    ffns = [_endpoint("ffn", a, f, port, r, **kw) for r in range(f)]
    atts = [_endpoint("attention", a, f, port, r, **kw) for r in range(a)]
    threads = [
        threading.Thread(target=guard, args=(f"ffn{r}", _serve, ep, parts, seen[r]))
        for r, ep in enumerate(ffns)
    ] + [
        threading.Thread(
            target=guard, args=(f"att{r}", _drive, ep, r, parts, shared, only)
        )
        for r, ep in enumerate(atts)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "an endpoint did not finish in 60 s"
    errors = {k: v for k, v in results.items() if isinstance(v, BaseException)}
    assert not errors, errors
    return results, seen


@pytest.mark.parametrize("payload", ["socket", "shared"])
@pytest.mark.parametrize("topo", ["1A1F", "2A1F", "1A2F", "2A2F", "3A2F", "1A3F"])
def test_async_round_trip_every_topology(topo, payload):
    a, f = int(topo[0]), int(topo[2])
    results, seen = _run(a, f, payload=payload)
    worst = max(results[f"att{r}"] for r in range(a))
    if f == 1:
        assert worst == 0.0  # one rank: the same sum in the same order
    else:
        assert worst < 1e-5
    # every FFN rank served items from every attention rank, rows of its own
    # experts only (the stand-in would not match otherwise)
    for r in range(f):
        assert {src for src, *_ in seen[r]} == set(range(a)), (r, seen[r][:3])
        lo, hi = ExpertSlices(E, f).bounds(r)
        assert all(len(counts) == hi - lo for _, _, _, counts, _ in seen[r])
        # shared: every item's rows in a slot (the slots hold 8192 rows)
        assert all(in_slot == (payload == "shared") for *_, in_slot in seen[r])


def test_shared_experts_run_on_rank_0_and_routed_parts_add_up():
    results, seen = _run(2, 2, parts=2, shared=True)
    assert max(results["att0"], results["att1"]) < 1e-5
    # rank 0 gets every row (shared experts), rank 1 only rows routed to it
    for step in range(STEPS):
        for rank in range(2):
            tokens = 3 + 2 * step + rank
            assert (rank, 1, tokens) in [s[:3] for s in seen[0]]


def test_an_ffn_rank_no_row_chose_gets_no_item():
    _, seen = _run(1, 2, only=0)
    assert seen[1] == [] and len(seen[0]) == STEPS * len(LAYERS)
    assert all(sum(counts) == tokens * K for _, _, tokens, counts, _ in seen[0])


def test_shared_payload_sends_what_outgrows_a_slot_on_the_socket():
    """``payload: shared`` with slots of 6 rows (1A1F): the items of 3 and 5 rows
    travel in slots, those of 7 and more on the socket, all exact; no ring
    file is left behind once the endpoints are up."""
    before = set(glob.glob(f"{async_slots.SHM_DIR}/vllm-afd-*"))
    results, seen = _run(1, 1, payload="shared", limits=ExchangeLimits(max_tokens=6))
    assert results["att0"] < 1e-5
    by_size = {(tokens, in_slot) for _, _, tokens, _, in_slot in seen[0]}
    assert {(3, True), (5, True), (7, False)} <= by_size, by_size
    assert set(glob.glob(f"{async_slots.SHM_DIR}/vllm-afd-*")) <= before


def test_payload_planes_that_differ_fail_both_roles_naming_the_option():
    port = free_port()
    ffn = _endpoint("ffn", 1, 1, port, 0, payload="socket")
    att = _endpoint("attention", 1, 1, port, 0, payload="shared")
    errors: dict[str, BaseException] = {}

    def start(name: str, ep) -> None:
        try:
            ep.start()
        except BaseException as e:  # checked below
            errors[name] = e

    threads = [
        threading.Thread(target=start, args=(n, ep))
        for n, ep in (("ffn", ffn), ("att", att))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert set(errors) == {"ffn", "att"}, errors
    for e in errors.values():
        assert isinstance(e, AFDConfigError), repr(e)
        assert "'payload'" in str(e) and "'shared'" in str(e), str(e)


def test_payload_cuda_ipc_refuses_a_role_on_the_cpu_naming_the_other_planes():
    with pytest.raises(AFDConfigError) as e:
        _endpoint("ffn", 1, 1, free_port(), 0, payload="cuda_ipc")
    assert "payload 'cuda_ipc' keeps its slot rings in GPU memory" in str(e.value)
    assert "runs on cpu: set payload 'shared' (one host) or 'socket'" in str(e.value)


def _gpu_run(topo: str, payload: str) -> dict:
    """Every endpoint of ``topo`` a process on GPU 0 (a CUDA IPC handle
    cannot be opened in the process that made it); outcomes by (role, rank)."""
    import _async_programs
    import _scenarios

    a, f = int(topo[0]), int(topo[2])
    port = free_port()
    eps = [("ffn", r) for r in range(f)] + [("attention", r) for r in range(a)]
    args = [(*ep, a, f, port, payload) for ep in eps]
    return _scenarios.run_processes(_async_programs.main, args, limit_s=120)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "topo,payload",
    [("1A1F", "cuda_ipc"), ("2A1F", "cuda_ipc"), ("1A2F", "cuda_ipc"),
     ("1A2F", "shared"), ("1A2F", "socket")],
)  # fmt: skip
def test_async_round_trip_on_a_gpu(topo, payload):
    """Rows and replies on GPU 0, each endpoint a process: every output
    exact against the experts' sum on the attention rank's GPU, and with
    ``cuda_ipc`` every item in an FFN rank's GPU slot, the FFN rank's
    output written device to device into the attention rank's slot."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = _gpu_run(topo, payload)
    bad = {ep: r for ep, r in out.items() if not r.get("ok")}
    assert not bad, bad
    a, f = int(topo[0]), int(topo[2])
    for r in range(a):
        worst = out[("attention", r)]["worst"]
        assert worst == 0.0 if f == 1 else worst < 1e-5, (r, worst)
    for r in range(f):
        seen = out[("ffn", r)]["seen"]
        assert {src for src, *_ in seen} == set(range(a)), seen[:3]
        assert all(in_slot == (payload != "socket") for *_, in_slot in seen)
        if payload == "cuda_ipc":
            assert all(dev == "cuda" for dev in out[("ffn", r)]["devices"])


def test_payload_shared_refuses_roles_on_other_hosts():
    theirs = {"payload": "shared", "host": "elsewhere/0", "ring": None}
    with pytest.raises(AFDConfigError, match="needs every role on one host"):
        async_slots._check_peer(theirs, "shared", "ffn rank 0")


def test_more_ffn_ranks_than_experts_are_refused():
    with pytest.raises(AFDConfigError, match="exceeds the model's 2 routed experts"):
        ExpertSlices(2, 3)
    assert [ExpertSlices(8, 3).bounds(r) for r in range(3)] == [(0, 3), (3, 6), (6, 8)]


def _reference_groups(slices: ExpertSlices, routing: Routing, shared: bool) -> list:
    """The grouping as first written: one owner mask, row pick and bincount
    per FFN rank, on the CPU."""
    ids, weights = routing.topk_ids, routing.topk_weights
    owner = slices.owners()[ids.long()]
    ranks, groups = slices.num_ffn_ranks, []
    for f in range(ranks):
        local = owner == f
        rows = None
        if ranks > 1 and not (shared and f == 0):
            chosen = local.any(dim=1)
            if not bool(chosen.any()):
                continue
            rows = chosen.nonzero().squeeze(1)
            if rows.numel() == ids.shape[0]:
                rows = None
        lo, hi = slices.bounds(f)
        mine, f_ids, f_w = (
            t if rows is None else t[rows] for t in (local, ids, weights)
        )
        ids_f = torch.where(mine, f_ids, lo).to(torch.int32)
        w_f = torch.where(mine, f_w, 0.0).to(torch.float32)
        counts = torch.bincount(ids_f[mine].long() - lo, minlength=hi - lo)
        groups.append((f, rows, ids_f, w_f, tuple(int(c) for c in counts)))
    return groups


def _reference_combine(hidden, sent, replies, parts: int) -> torch.Tensor:
    """The combine as first written: zeros, each rank's part as float32
    added in rank order, one rounding."""
    tokens, width = hidden.shape
    routed = torch.zeros(tokens, width, dtype=torch.float32)
    out = hidden.new_empty((tokens, parts * width))
    for f, rows, _ in sent:
        part = replies[f][:, (parts - 1) * width :].float()
        if rows is None:
            routed += part
        else:
            routed.index_add_(0, rows, part)
        if parts == 2 and f == 0:
            out[:, :width] = replies[f][:, :width]
    out[:, (parts - 1) * width :] = routed
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)  # tells -0.0 from 0.0, unlike ==


@pytest.mark.parametrize(
    ("ranks", "shared", "dtype"),
    [
        (1, False, torch.bfloat16),
        (2, False, torch.float32),
        (2, True, torch.bfloat16),
        (3, False, torch.bfloat16),
        (3, True, torch.float32),
    ],
)
def test_grouping_and_combine_match_the_per_rank_reference_bit_for_bit(
    ranks, shared, dtype
):
    experts, top_k, width = 12, 3, 8
    slices = ExpertSlices(experts, ranks)
    owners = slices.owners()
    buffers = async_rows.HostBuffers()
    g = torch.Generator().manual_seed(7 * ranks + shared)
    # random rows (some choose no expert of a rank), every row on rank 1's
    # first expert, no row on the last rank, and no rows at all; the kept
    # buffers serve shapes large and small in turn
    for case, tokens in [("random", 37), ("rank1", 29), ("not-last", 41),
                         ("random", 5), ("random", 0)]:  # fmt: skip
        ids = torch.rand(tokens, experts, generator=g).argsort(1)[:, :top_k]
        if case == "rank1" and ranks > 1:
            lo = slices.bounds(1)[0]
            ids[:, 0] = torch.where((ids[:, 1:] == lo).any(1), ids[:, 0], lo)
        if case == "not-last":
            lo, hi = slices.bounds(ranks - 1)
            ids = ids % lo if lo else ids
        weights = torch.rand(tokens, top_k, generator=g).to(dtype)
        routing = Routing(weights, ids.to(torch.int32))
        want = _reference_groups(slices, routing, shared)
        # the CPU's NumPy grouping and the torch one of devices (run here on
        # the CPU), each against the reference
        for group in (async_rows._group_rows_host, async_rows._group_rows_device):
            groups = group(owners, slices, routing, shared)
            assert [gr.rank for gr in groups] == [w[0] for w in want], case
            for gr, (_, rows, ids_f, w_f, counts) in zip(groups, want, strict=True):
                assert (gr.rows is None) == (rows is None), case
                if rows is not None:
                    assert torch.equal(gr.rows, rows) and gr.rows.dtype == torch.int64
                assert torch.equal(gr.ids, ids_f) and gr.ids.dtype == torch.int32
                assert gr.weights.dtype == torch.float32
                assert torch.equal(_bits(gr.weights), _bits(w_f))
                assert gr.counts == counts
        groups = async_rows.group_rows(owners, slices, routing, shared)
        for parts in (1, 2) if shared or ranks == 1 else (1,):
            hidden = torch.randn(tokens, width, generator=g).to(dtype)
            sent = [(gr.rank, gr.rows, 0) for gr in groups]
            replies = {}
            for gr in groups:
                reply = torch.randn(gr.ids.shape[0], parts * width, generator=g)
                reply[::3, ::2] = -0.0  # signed zeros must add up as before
                replies[gr.rank] = reply.to(dtype)
            got = async_rows.combine(hidden, sent, replies, parts, buffers)
            ref = _reference_combine(hidden, sent, replies, parts)
            if async_rows.reply_is_output(sent):
                ref = replies[sent[0][0]]
            assert got.dtype == dtype and got.shape == ref.shape, case
            assert torch.equal(_bits(got), _bits(ref)), (case, parts)


def test_an_ffn_rank_lends_its_kept_buffer_to_one_item_of_a_rank_at_a_time():
    """Rows of attention rank a go into the buffer kept for a, lent to one
    item until its reply: a frame arriving meanwhile gets a fresh buffer,
    and the kept one serves the next item once the reply is out."""
    ep = _endpoint("ffn", 2, 1, free_port(), 0)
    assert isinstance(ep, AsyncFFN)
    first = ep._buffer_for(0, 256)
    meanwhile = ep._buffer_for(0, 256)
    other_rank = ep._buffer_for(1, 256)
    assert meanwhile.data_ptr() != first.data_ptr()
    assert other_rank.data_ptr() not in (first.data_ptr(), meanwhile.data_ptr())
    _, routing = _inputs(0, 0, 1, 1)
    hidden = first[: 4 * H].view(torch.float32).view(1, H)  # as Frame.tensors
    item = async_ep.WorkItem(0, 1, 1, hidden, routing, ())
    ep._release(item)  # as reply() does once the reply is sent
    again = ep._buffer_for(0, 128)
    assert again.data_ptr() == first.data_ptr()
    ep._give_back(0, meanwhile)  # not the kept one: stays lent
    assert ep._buffer_for(0, 64).data_ptr() != first.data_ptr()
    ep._give_back(0, again)  # a frame that was no item (a SHUTDOWN)
    assert ep._buffer_for(0, 512).numel() == 512  # grown, kept again
    assert ep._buffer_for(0, 0).numel() == 0


def test_config_implies_gate_on_attention_and_refuses_what_async_cannot_do():
    cfg = parse_afd_config(
        {"role": "attention", "connector": "async", "num_ffn_ranks": 2}
    )
    assert cfg.compute_gate_on_attention and cfg.is_async
    assert cfg.topology.all_to_all and cfg.topology.ffn_peers(0) == (0, 1)
    with pytest.raises(AFDConfigError, match="attention rank must route"):
        parse_afd_config(
            {"role": "ffn", "connector": "async", "compute_gate_on_attention": False}
        )
    staged = parse_afd_config(
        {"role": "attention", "connector": "async", "num_ubatches": 2}
    )
    assert staged.num_ubatches == 2  # request-boundary stages (CPU)
    with pytest.raises(AFDConfigError, match="async connector allows fewer"):
        parse_afd_config({"role": "attention", "num_ffn_ranks": 2})
    with pytest.raises(AFDConfigError, match="create_async_endpoint"):
        create_connector(cfg, 0, _fp(1, 2))
    with pytest.raises(AFDConfigError, match="is not asynchronous"):
        create_async_endpoint(parse_afd_config({"role": "ffn"}), 0, _fp(1, 1))


def test_fingerprint_mismatch_fails_both_roles_naming_the_field():
    port = free_port()
    ffn = _endpoint("ffn", 1, 1, port, 0)
    att = _endpoint("attention", 1, 1, port, 0, top_k=3)
    errors: dict[str, BaseException] = {}

    def start(name: str, ep) -> None:
        try:
            ep.start()
        except BaseException as e:
            errors[name] = e

    threads = [threading.Thread(target=start, args=(n, ep)) for n, ep in
               (("ffn", ffn), ("att", att))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert set(errors) == {"ffn", "att"}
    for e in errors.values():
        assert isinstance(e, AFDProtocolError) and "top_k" in str(e), e


def _ffn_process(port: int, rank: int, die_after: int) -> None:
    ep = _endpoint("ffn", 1, 2, port, rank)
    ep.start()
    for _ in range(die_after):
        item = ep.next_item()
        assert item is not None
        ep.reply(item, _expert_sum(item.hidden, item.routing))
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_ffn_rank_fails_the_exchange_at_once_naming_it():
    port = free_port()
    proc = mp.get_context("forkserver").Process(target=_ffn_process, args=(port, 1, 2))
    proc.start()
    ffn0 = _endpoint("ffn", 1, 2, port, 0)
    served = threading.Thread(target=_serve, args=(ffn0, 1, []), daemon=True)
    served.start()
    att = _endpoint("attention", 1, 2, port, 0)
    att.start()
    try:
        for step in range(2):
            hidden, routing = _inputs(0, step, 1, 8)
            att.exchange(1, hidden, routing, 1, False, 10.0)
        hidden, routing = _inputs(0, 2, 1, 8)
        start = time.monotonic()
        gone = "ffn rank 1 (closed its connection|is unreachable)"  # EOF or EPIPE
        with pytest.raises(AFDPeerError, match=gone):
            att.exchange(1, hidden, routing, 1, False, 10.0)
        assert time.monotonic() - start < 5.0  # EOF, not the timeout
        with pytest.raises(Exception, match="failed earlier: ffn rank 1"):
            att.exchange(1, hidden, routing, 1, False, 10.0)
    finally:
        att.close()
        proc.join(10)
        served.join(10)
    assert not served.is_alive()  # FFN 0 ended with the attention rank's SHUTDOWN


def test_a_silent_ffn_rank_times_out_after_timeout_s_naming_it():
    att, (ffn,) = _pair()
    hidden, routing = _inputs(0, 0, 1, 4)
    start = time.monotonic()
    with pytest.raises(AFDTimeoutError, match=r"after 0.5s .* ffn rank 0 to layer 1"):
        att.exchange(1, hidden, routing, 1, False, 0.5)
    assert 0.5 <= time.monotonic() - start < 3.0
    assert ffn.next_item() is not None  # it got the item, it just never replied
    att.close()
    assert ffn.next_item() is None  # the attention rank shut down
    ffn.close()


def test_close_from_another_thread_ends_an_idle_ffn_wait():
    att, (ffn,) = _pair()
    threading.Timer(0.3, ffn.close).start()
    assert ffn.next_item() is None
    att.close()


def test_frames_refuse_another_protocol():
    import socket

    a, b = socket.socketpair()
    a.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 40)
    b.setblocking(False)
    with pytest.raises(AFDProtocolError, match="without the async connector's magic"):
        FrameReader(b, "peer").read()
    head = encode_header(
        FrameKind.WORK, dtype=torch.bfloat16, layer=3, seq=7, tokens=0, cols=H,
        top_k=K, counts=(1, 2), nbytes=0,
    )  # fmt: skip
    a.sendall(head)
    frame = FrameReader(b, "peer").read()[0]
    assert (frame.kind, frame.dtype, frame.layer, frame.seq, frame.counts) == (
        FrameKind.WORK, torch.bfloat16, 3, 7, (1, 2),
    )  # fmt: skip
    a.close()
    b.close()


def _pair(f: int = 1, port: int | None = None, payload: str = "socket"):
    """A started attention rank and FFN ranks (1A``f``F), no items yet."""
    port = free_port() if port is None else port
    ffns = [_endpoint("ffn", 1, f, port, r, payload=payload) for r in range(f)]
    att = _endpoint("attention", 1, f, port, 0, payload=payload)
    starters = [threading.Thread(target=ep.start) for ep in ffns]
    for t in starters:
        t.start()
    att.start()
    for t in starters:
        t.join(30)
    return att, ffns


def _watched(att) -> tuple[threading.Event, list[str]]:
    lost, why = threading.Event(), []
    att.watch_peers(lambda w, rank: (why.append(w), lost.set()), period_s=0.1)
    return lost, why


@pytest.mark.parametrize("payload", ["socket", "shared"])
def test_two_stages_in_flight_read_their_own_replies_and_the_watch_waits(payload):
    """Request-boundary stages (``worker.stages``): two exchanges of a layer
    dispatched before either is finished, on 1A2F. Both FFN ranks have
    answered both before the first finish reads, so each read must take its
    own reply only (``shared``: each in its own slot); the watch stays off the
    connections until the last ends."""
    att, ffns = _pair(f=2, payload=payload)
    seen: list = []
    servers = [
        threading.Thread(target=_serve_items, args=(ffn, seen), daemon=True)
        for ffn in ffns
    ]
    for t in servers:
        t.start()
    lost, _ = _watched(att)
    stages = [_inputs(0, 0, 1, n) for n in (5, 3)]
    pending = [att.dispatch(1, h, r, 1, False, 10.0) for h, r in stages]
    deadline = time.monotonic() + 10
    while len(seen) < 4 and time.monotonic() < deadline:  # every reply sent
        time.sleep(0.01)
    assert len(seen) == 4, seen
    assert not att._io.acquire(blocking=False)  # held: two in flight
    for p, (hidden, routing) in zip(pending, stages, strict=True):
        out = att.finish(p, 10.0)
        assert torch.allclose(out, _expert_sum(hidden, routing), atol=1e-6)
    assert att._io.acquire(blocking=False)  # free once the last ended
    att._io.release()
    assert not lost.is_set()
    att.close()
    for t in servers:
        t.join(10)


def test_shared_payload_sends_a_third_item_in_flight_and_its_reply_on_the_socket():
    """Three exchanges of 1A1F dispatched before any is finished, on
    ``payload: shared``: the two rings hold two items each, so the third
    item and its reply travel on the socket, and each finish reads its own
    reply, exact (the third reply must not overwrite the first's slot)."""
    att, (ffn,) = _pair(payload="shared")
    seen: list = []
    in_slot: list[bool] = []

    def serve() -> None:
        while (item := ffn.next_item()) is not None:
            in_slot.append(item.in_slot)
            ffn.reply(item, _expert_sum(item.hidden, item.routing))
            seen.append(item.seq)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    stages = [_inputs(0, 0, 1, n) for n in (5, 3, 4)]
    pending = [att.dispatch(1, h, r, 1, False, 10.0) for h, r in stages]
    deadline = time.monotonic() + 10
    while len(seen) < 3 and time.monotonic() < deadline:  # every reply sent
        time.sleep(0.01)
    assert in_slot == [True, True, False], in_slot
    for p, (hidden, routing) in zip(pending, stages, strict=True):
        out = att.finish(p, 10.0)
        assert torch.equal(out, _expert_sum(hidden, routing))
    att.close()
    server.join(10)


def _serve_items(ffn, seen: list) -> None:
    while (item := ffn.next_item()) is not None:
        ffn.reply(item, _expert_sum(item.hidden, item.routing))
        seen.append(item.seq)


def test_the_watch_reports_an_ffn_rank_that_shuts_down_between_exchanges():
    att, (ffn,) = _pair()
    lost, why = _watched(att)
    hidden, routing = _inputs(0, 0, 1, 4)
    threading.Thread(target=lambda: _serve_one(ffn), daemon=True).start()
    att.exchange(1, hidden, routing, 1, False, 10.0)  # the watch stays quiet
    assert not lost.wait(0.5)
    ffn.close("stopped for the test")
    assert lost.wait(5.0), "the watch did not report the SHUTDOWN"
    assert why == ["ffn rank 0 shut down (stopped for the test)"]
    att.close()


def _serve_one(ffn) -> None:
    item = ffn.next_item()
    ffn.reply(item, _expert_sum(item.hidden, item.routing))


def _with_ffn_rank_1_killed_idle(port: int):
    """1A2F at ``port`` whose FFN rank 1 (a process) dies right after the
    rendezvous: (that process, started FFN rank 0, started attention rank)."""
    proc = mp.get_context("forkserver").Process(target=_ffn_process, args=(port, 1, 0))
    proc.start()
    ffn0 = _endpoint("ffn", 1, 2, port, 0)
    starter = threading.Thread(target=ffn0.start)
    starter.start()
    att = _endpoint("attention", 1, 2, port, 0)
    att.start()
    starter.join(30)
    return proc, ffn0, att


def test_the_watch_reports_a_killed_idle_ffn_rank():
    port = free_port()
    proc, ffn0, att = _with_ffn_rank_1_killed_idle(port)
    lost, why = _watched(att)
    try:
        assert lost.wait(10.0), "the watch did not report the killed rank"
        assert why == ["ffn rank 1 closed its connection (it exited or was killed)"]
        att.close()
        # FFN rank 0 hears why the attention rank ended
        assert ffn0.next_item() is None
        assert ffn0.failed_peers() == [f"attention rank 0: {why[0]}"]
    finally:
        att.close()
        proc.join(10)
        ffn0.close()


def test_an_attention_rank_that_failed_says_so_to_the_ffn_ranks():
    att, (ffn,) = _pair()
    hidden, routing = _inputs(0, 0, 1, 4)
    with pytest.raises(AFDTimeoutError):
        att.exchange(1, hidden, routing, 1, False, 0.2)  # nobody serves
    att.close()
    assert ffn.next_item() is not None  # the item that was never answered
    assert ffn.next_item() is None
    assert ffn.failed_peers() == [
        "attention rank 0: timed out after 0.2s waiting for the reply of ffn "
        "rank 0 to layer 1 (hung, stopped or overloaded)"
    ]
    ffn.close()


def test_a_lost_ffn_rank_names_itself_and_the_session_reforms_with_its_successor():
    """What the attention rank's FFN link does (``worker.ffn_link``): the
    watch names the lost rank, the attention rank leaves with a ``rejoin:``
    SHUTDOWN, the surviving FFN rank reads it as a re-forming session (not a
    stop), and all of them, the lost rank's successor too, rendezvous again
    on the same port and exchange exactly."""
    from vllm_afd.connector.protocol import REJOIN

    port = free_port()
    proc, ffn0, att = _with_ffn_rank_1_killed_idle(port)
    lost, said = threading.Event(), []
    att.watch_peers(lambda why, rank: (said.append((why, rank)), lost.set()))
    try:
        assert lost.wait(10.0), "the watch did not report the killed rank"
        [(why, rank)] = said
        assert rank == 1 and why.startswith("ffn rank 1 closed its connection")
        att.close(f"{REJOIN}attention rank 0 lost ffn rank 1: {why}")
        assert ffn0.next_item() is None
        assert ffn0.rejoining() == f"attention rank 0 lost ffn rank 1: {why}"
        assert ffn0.failed_peers() == []  # no stop: the session re-forms
    finally:
        proc.join(10)
        ffn0.close()
    ffns = [_endpoint("ffn", 1, 2, port, r) for r in range(2)]
    served = [
        threading.Thread(target=_serve, args=(ep, 1, []), daemon=True) for ep in ffns
    ]
    for t in served:
        t.start()
    again = _endpoint("attention", 1, 2, port, 0)
    assert _drive(again, 0, 1, False) < 1e-4  # closes with a plain SHUTDOWN
    for t in served:
        t.join(10)
    assert all(ep.rejoining() is None for ep in ffns)  # this time they stop


def test_a_reply_to_an_attention_rank_that_left_is_dropped_not_raised():
    """An FFN rank replying while its attention rank leaves does not fail:
    the receiving thread says what the leaving means."""
    att, (ffn,) = _pair()
    hidden, routing = _inputs(0, 0, 1, 4)
    with pytest.raises(AFDTimeoutError):
        att.exchange(1, hidden, routing, 1, False, 0.2)
    item = ffn.next_item()
    assert item is not None
    att.close()
    for _ in range(3):  # a full socket buffer or EPIPE: dropped either way
        ffn.reply(item, torch.zeros(4, H))
    assert ffn.next_item() is None
    ffn.close()


def _served_session(port: int, f: int = 2):
    """Started FFN ranks, each served by a real ``AsyncFFNLoop``, and a
    started attention rank (1A``f``F)."""
    from vllm_afd.worker.async_loop import AsyncFFNLoop

    att, ffns = _pair(f, port)
    loops = [
        AsyncFFNLoop(ep, lambda layer, b: _expert_sum(b.hidden, b.routing))
        for ep in ffns
    ]
    for loop in loops:
        loop.start()
    return att, loops


def _async_step(exchange, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One step through every layer: (want, got) per layer."""
    exchange.failure = None
    exchange.begin_step(8)
    out = []
    for layer in LAYERS:
        hidden, routing = _inputs(0, step, layer, 8)
        got = exchange.exchange(hidden, layer, routing, 1)
        out.append((_expert_sum(hidden, routing), got))
    return out


def test_the_attention_link_serves_zeros_names_the_lost_rank_and_rejoins(monkeypatch):
    """``async`` under the attention rank's FFN link, as the worker runs it:
    FFN rank 1 stops, the step in flight fails (zeros, ``failure`` set), the
    link goes down naming rank 1, and its reconnect (every FFN rank back at
    the same port) brings the exact exchange back."""
    from vllm_afd.models.async_exchange import AsyncAttentionExchange
    from vllm_afd.worker import ffn_link
    from vllm_afd.worker.ffn_link import FFNLink

    monkeypatch.setattr(ffn_link, "RETRY_S", 0.01)
    port = free_port()
    att, loops = _served_session(port)
    everything = list(loops)

    def reconnect():
        again, new_loops = _served_session(port)
        everything.extend(new_loops)
        return again

    states = []
    link = FFNLink(att, reconnect, attention_rank=0, ffn_rank=0, publish=states.append)
    exchange = AsyncAttentionExchange(att, False, link=link)
    try:
        for want, got in _async_step(exchange, 0):
            assert torch.allclose(got, want, atol=1e-5)
        loops[1].stop()  # FFN rank 1 shuts down
        results = _async_step(exchange, 1)
        assert exchange.failure is not None and "ffn rank 1" in exchange.failure
        assert all(torch.count_nonzero(got) == 0 for _, got in results)
        deadline = time.monotonic() + 30
        while not link.state.up:
            assert time.monotonic() < deadline, "the link never rejoined"
            time.sleep(0.01)
        down = states[1]
        assert (down.up, down.ffn_rank) == (False, 1)
        assert link.state.rejoins == 1 and link.connector is not att
        for want, got in _async_step(exchange, 2):
            assert torch.allclose(got, want, atol=1e-5)
        assert exchange.failure is None
    finally:
        link.close()
        for loop in everything:
            loop.stop()


def test_a_forward_that_records_piecewise_graphs_sends_nothing():
    """In the forward where vLLM records the piecewise graphs around the
    exchange (CAPTURE), the graph before it was recorded, not run, so the
    op's rows and routing are stale memory (here ids out of range, NaN
    rows): nothing reaches an FFN rank, the op returns zeros, and the next
    served step is exact."""
    from vllm_afd.connector.payloads import Routing
    from vllm_afd.connector.protocol import ExecMode
    from vllm_afd.models.async_exchange import AsyncAttentionExchange

    att, loops = _served_session(free_port())
    exchange = AsyncAttentionExchange(att, False)
    try:
        exchange.begin_step(8, ExecMode.CAPTURE)
        stale = Routing(
            torch.full((8, K), float("nan")),
            torch.tensor([[-7, 10**6]] * 8, dtype=torch.int32),
        )
        for layer in LAYERS:
            got = exchange.exchange(torch.full((8, H), float("nan")), layer, stale, 1)
            assert got.shape == (8, H) and torch.count_nonzero(got) == 0
        assert exchange.failure is None
        assert [loop.stats.steps for loop in loops] == [0, 0]
        for want, got in _async_step(exchange, 1):
            assert torch.allclose(got, want, atol=1e-5)
    finally:
        att.close()
        for loop in loops:
            loop.stop()


def test_rows_with_out_of_range_expert_ids_go_nowhere_and_the_rest_is_exact():
    """Padding rows of a CUDA-graph batch, and the dummy forwards that warm
    up graph capture, route stale memory: expert ids below 0 or past the
    last expert, NaN weights. Such a pair goes nowhere (vLLM's fused MoE
    skips it too); the rows beside them are answered exactly, on one FFN
    rank and with the experts split over two."""
    from vllm_afd.models.async_exchange import AsyncAttentionExchange

    for f in (1, 2):
        att, loops = _served_session(free_port(), f)
        exchange = AsyncAttentionExchange(att, False)
        try:
            exchange.begin_step(8)
            for layer in LAYERS:
                hidden, routing = _inputs(0, 5, layer, 8)
                routing.topk_ids[6] = torch.tensor([-3, E + 5], dtype=torch.int32)
                routing.topk_ids[7, 1] = -1
                routing.topk_weights[6:] = float("nan")
                got = exchange.exchange(hidden, layer, routing, 1)
                want = _expert_sum(hidden[:6], Routing(
                    routing.topk_weights[:6], routing.topk_ids[:6]
                ))  # fmt: skip
                assert torch.allclose(got[:6], want, atol=1e-5), f
            assert exchange.failure is None
        finally:
            att.close()
            for loop in loops:
                loop.stop()


def test_a_work_item_whose_compute_stalls_logs_the_ffn_stack(caplog):
    """The async FFN loop's stall watch: a work item's compute that does not
    return logs the serving thread's stack after its bound, naming
    the item, its attention rank, layer and rows; the reply then arrives."""
    from vllm_afd.worker.async_loop import AsyncFFNLoop, describe_item
    from vllm_afd.worker.stall_watch import StallWatch

    caplog.set_level("WARNING", logger="vllm_afd.worker.stall_watch")
    release = threading.Event()

    def held(layer: int, batch) -> torch.Tensor:
        release.wait(30)
        return _expert_sum(batch.hidden, batch.routing)

    att, (ffn,) = _pair()
    watch = StallWatch("ffn rank 0", 0.2, describe_item)
    loop = AsyncFFNLoop(ffn, held, watch=watch)
    loop.start()
    try:
        hidden, routing = _inputs(0, 1, LAYERS[0], 4)
        pending = att.dispatch(LAYERS[0], hidden, routing, 1, False, 30.0)
        deadline = time.monotonic() + 10
        while not any("computing for" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "no stall logged"
            threading.Event().wait(0.02)
        (msg,) = [
            r.getMessage() for r in caplog.records if "computing" in r.getMessage()
        ]
        assert msg.startswith(
            f"AFD ffn rank 0: work item 1 of attention rank 0 (layer {LAYERS[0]}, "
            "4 rows): computing for "
        ), msg
        assert "in held" in msg, msg
        release.set()
        got = att.finish(pending, 30.0)
        assert torch.equal(got, _expert_sum(hidden, routing))
    finally:
        release.set()
        att.close()
        loop.stop()
