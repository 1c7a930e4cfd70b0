"""Benchmark: connector A2F+F2A round trip vs raw torch.distributed send/recv.

Two processes (attention rank 0, ffn rank 0, ``p2p`` connector, 1A1F). For
every (tokens, hidden) the attention side times ``send_a2f`` + ``recv_f2a``
while the FFN echoes the batch back; in the same run and the same processes it
times a raw ``send`` + ``recv`` of the same tensors on a separate process group
of the same backend. Raw and connector alternate every iteration (so both see
the same machine state), and so does which of the two goes first; medians
are reported. Iterations run in steps of
``LAYERS`` layers, as the serving loops do: a step plan before each step
(untimed), and the FFN waits its sends at the end of the step (the connector
does it at the next plan), raw and connector alike. Each role is pinned to its own
CPU core unless ``--no-pin``. On CUDA each size is also measured inside CUDA
graphs (``mode: graph``): 16 round trips recorded per graph, raw NCCL in one,
the connector's in another, replayed alternately; a round trip is a replay's
time over 16. Step plans are host messages outside graphs and not included.

    python tools/bench_connector.py                       # CPU, Gloo
    python tools/bench_connector.py --device cuda         # NCCL, eager and graph
    python tools/bench_connector.py --device cuda --backend cuda_ipc
        # CUDA IPC; on one GPU (MPS on) raw is the device-copy floor
    python tools/bench_connector.py --json out.json --iters 200

Dimensions: T tokens, H hidden size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from vllm_afd.config import parse_afd_config
from vllm_afd.connector import (
    ExecMode,
    Fingerprint,
    StepPlan,
    create_connector,
)

LAYERS = 64
#: round trips recorded in one CUDA graph (one per layer of a decode step)
GRAPH_LAYERS = 16


def _free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            for off in (1, 2):
                with socket.socket() as s2:
                    s2.bind(("127.0.0.1", port + off))
        except OSError:
            continue
        return port


def _schedule(args: argparse.Namespace) -> list[tuple[int, int]]:
    return [(t, h) for h in args.hidden for t in args.tokens]


def _connector(args, role: str, hidden: int, port: int, device: torch.device):
    cfg = parse_afd_config(
        {"role": role, "host": "127.0.0.1", "port": port, "connector": "p2p",
         "connector_extra_config": {"backend": args.backend,
                                    "ipc_copy": args.ipc_copy}}
    )  # fmt: skip
    fp = Fingerprint(
        arch="bench", hidden_size=hidden, dtype=args.dtype, num_layers=LAYERS,
        moe_layers=tuple(range(LAYERS)), num_experts=1, top_k=1,
        num_attention_ranks=1, num_ffn_ranks=1, compute_gate_on_attention=False,
        connector="p2p",
    )  # fmt: skip
    return create_connector(cfg, 0, fp, device)


class _CopyFloor:
    """The raw baseline where NCCL cannot run (both roles on one GPU): the
    attention side copies the tensor there and back on the device (what a
    round trip moves), the FFN side does nothing."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._mid: torch.Tensor | None = None

    def round_trip(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if self._mid is None or self._mid.shape != x.shape:
            self._mid = torch.empty_like(x)
        self._mid.copy_(x)
        out.copy_(self._mid)


def _raw_group(args, rank: int, port: int) -> dist.ProcessGroup | _CopyFloor:
    if args.raw == "copy":
        return _CopyFloor(rank)
    td = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port + 2, None, rank == 0, td)
    prefix = dist.PrefixStore("raw/", store)
    if args.device == "cuda":
        return dist.ProcessGroupNCCL(prefix, rank, 2, dist.ProcessGroupNCCL.Options())
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = td
    return dist.ProcessGroupGloo(prefix, rank, 2, opts)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pin(args, cpu: int) -> None:
    # On small machines, the scheduler can park both processes' threads on one
    # core and add ~4 ms per wake-up at random; one core per role is stable.
    if args.pin and hasattr(os, "sched_setaffinity") and os.cpu_count() >= 2:
        os.sched_setaffinity(0, {cpu})


def _setup(args, role_cpu: int, gpu: int) -> tuple[torch.device, torch.dtype]:
    _pin(args, role_cpu)
    if args.device == "cuda":
        torch.cuda.set_device(gpu)
        return torch.device("cuda", gpu), getattr(torch, args.dtype)
    return torch.device("cpu"), getattr(torch, args.dtype)


def _attention(args, port: int, q: Any) -> None:
    device, dtype = _setup(args, 0, 0)
    pg = _raw_group(args, 1, port)
    gloo = device.type == "cpu"
    copy_floor = isinstance(pg, _CopyFloor)
    rows = []
    plan_id = 0
    for hid in args.hidden:
        conn = _connector(args, "attention", hid, port, device)
        conn.start()
        for tok in [t for t, h in _schedule(args) if h == hid]:
            x = torch.randn(tok, hid).to(device, dtype)
            buf = torch.empty_like(x)
            raw_t: list[float] = []
            conn_t: list[float] = []
            # Raw and connector alternate every iteration: both see the same
            # machine state, so the ratio is not skewed by drift.
            for i in range(args.warmup + args.iters):
                if i % LAYERS == 0:
                    conn.send_plan(StepPlan(plan_id, ExecMode.EAGER, (tok,)))
                    plan_id += 1
                # Who goes first alternates too: the second round trip of an
                # iteration runs on warmer threads.
                for which in (i % 2, 1 - i % 2):
                    _sync(device)
                    t0 = time.perf_counter()
                    if which == 0 and copy_floor:
                        pg.round_trip(x, buf)
                    elif which == 0:
                        # The schedule the connector uses: on Gloo the receive
                        # is posted first (fast path); on NCCL it must follow
                        # the send, or it would block the stream ahead of it.
                        if gloo:
                            r = pg.recv([buf], 0, i % 1024)
                            w = pg.send([x], 0, i % 1024)
                        else:
                            w = pg.send([x], 0, i % 1024)
                            r = pg.recv([buf], 0, i % 1024)
                        w.wait()
                        r.wait()
                    else:
                        h = conn.send_a2f(i % LAYERS, 0, x)
                        out = conn.recv_f2a(i % LAYERS, 0)
                        h.wait()
                    _sync(device)
                    if i >= args.warmup:
                        times = conn_t if which else raw_t
                        times.append(time.perf_counter() - t0)
            assert torch.equal(out, x) and torch.equal(buf, x), "echo mismatch"
            raw_us = statistics.median(raw_t) * 1e6
            conn_us = statistics.median(conn_t) * 1e6
            rows.append(
                {"tokens": tok, "hidden": hid, "dtype": args.dtype,
                 "device": args.device, "mode": "eager", "raw_us": raw_us,
                 "connector_us": conn_us, "ratio": conn_us / raw_us}
            )  # fmt: skip
            if not gloo:
                raw_us, conn_us = _graph_attention(args, conn, pg, x, plan_id)
                plan_id += 1
                rows.append(
                    {"tokens": tok, "hidden": hid, "dtype": args.dtype,
                     "device": args.device, "mode": "graph", "raw_us": raw_us,
                     "connector_us": conn_us, "ratio": conn_us / raw_us}
                )  # fmt: skip
        conn.close()
    q.put(rows)


def _graph_attention(args, conn, pg, x: torch.Tensor, step: int) -> tuple[float, float]:
    """Round trips recorded in CUDA graphs, ``GRAPH_LAYERS`` per graph: raw
    NCCL send/recv in one graph, the connector's in another; the two replay
    alternately and each round trip's time is a replay's over GRAPH_LAYERS."""
    outs = [torch.empty_like(x) for _ in range(GRAPH_LAYERS)]
    raw_graph, conn_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(raw_graph):
        for layer in range(GRAPH_LAYERS):
            if isinstance(pg, _CopyFloor):
                pg.round_trip(x, outs[layer])
                continue
            w = pg.send([x], 0, layer)
            r = pg.recv([outs[layer]], 0, layer)
            w.wait()
            r.wait()
    conn.send_plan(StepPlan(step, ExecMode.CAPTURE, (x.shape[0],)))
    with torch.cuda.graph(conn_graph):
        for layer in range(GRAPH_LAYERS):
            sent = conn.send_a2f(layer, 0, x)
            conn.recv_f2a(layer, 0, out=outs[layer])
            sent.wait()
    raw_t: list[float] = []
    conn_t: list[float] = []
    for i in range(args.warmup + args.iters):
        for graph, times in ((raw_graph, raw_t), (conn_graph, conn_t)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            if i >= args.warmup:
                times.append((time.perf_counter() - t0) / GRAPH_LAYERS)
    assert all(torch.equal(o, x) for o in outs), "echo mismatch"
    return statistics.median(raw_t) * 1e6, statistics.median(conn_t) * 1e6


def _graph_ffn(args, conn, pg, buf: torch.Tensor) -> None:
    """The FFN half of :func:`_graph_attention`: echo graphs, same order."""
    raw_graph, conn_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    if isinstance(pg, _CopyFloor):
        raw_graph = None
    else:
        with torch.cuda.graph(raw_graph):
            for layer in range(GRAPH_LAYERS):
                pg.recv([buf], 1, layer).wait()
                pg.send([buf], 1, layer).wait()
    plan = conn.recv_plan()
    assert plan is not None and plan.mode is ExecMode.CAPTURE
    with torch.cuda.graph(conn_graph):
        for layer in range(GRAPH_LAYERS):
            batch = conn.recv_a2f(layer, 0)
            conn.send_f2a(layer, 0, batch.hidden)
        conn.flush()
    for _ in range(args.warmup + args.iters):
        if raw_graph is not None:
            raw_graph.replay()
        conn_graph.replay()
    torch.cuda.synchronize()


def _ffn(args, port: int) -> None:
    device, dtype = _setup(args, 1, 1 % max(torch.cuda.device_count(), 1))
    pg = _raw_group(args, 0, port)
    for hid in args.hidden:
        conn = _connector(args, "ffn", hid, port, device)
        conn.start()
        for tok in [t for t, h in _schedule(args) if h == hid]:
            # Echoed from the buffer it arrived in, raw and connector alike:
            # the next layer's A2F leaves only after this echo has arrived.
            buf = torch.empty(tok, hid, device=device, dtype=dtype)
            sent: list[dist.Work] = []
            for i in range(args.warmup + args.iters):
                if i % LAYERS == 0:
                    for work in sent:
                        work.wait()
                    sent.clear()
                    assert conn.recv_plan() is not None
                for which in (i % 2, 1 - i % 2):
                    if which == 0 and isinstance(pg, _CopyFloor):
                        continue
                    if which == 0:
                        pg.recv([buf], 1, i % 1024).wait()
                        sent.append(pg.send([buf], 1, i % 1024))
                    else:
                        batch = conn.recv_a2f(i % LAYERS, 0)
                        conn.send_f2a(i % LAYERS, 0, batch.hidden)
            for work in sent:
                work.wait()
            if device.type == "cuda":
                _graph_ffn(args, conn, pg, buf)
        assert conn.recv_plan() is None
        conn.close()


def _table(rows: list[dict]) -> str:
    head = (
        f"{'mode':>6} {'tokens':>7} {'hidden':>7} {'MiB':>7} {'raw us':>10} "
        f"{'conn us':>10} {'ratio':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        mib = r["tokens"] * r["hidden"] * torch.finfo(getattr(torch, r["dtype"])).bits
        lines.append(
            f"{r['mode']:>6} {r['tokens']:>7} {r['hidden']:>7} {mib / 8 / 2**20:>7.2f} "
            f"{r['raw_us']:>10.1f} {r['connector_us']:>10.1f} {r['ratio']:>6.2f}"
        )
    return "\n".join(lines)


def _results(q: Any, procs: list, timeout_s: float) -> list[dict] | None:
    """The attention role's rows; None (after saying why) if a role process
    died first or the run outlived ``timeout_s``."""
    import queue

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            # never past the deadline: a wait of 1 s could outlast a short
            # --timeout and return the results after it
            return q.get(timeout=min(1.0, max(deadline - time.monotonic(), 0.01)))
        except queue.Empty:
            pass
        dead = [p for p in procs if not p.is_alive() and p.exitcode != 0]
        if dead:
            role = "ffn" if dead[0] is procs[0] else "attention"
            print(f"the {role} process failed (exit code {dead[0].exitcode}); "
                  "its traceback is above", file=sys.stderr)  # fmt: skip
            break
    else:
        print(f"no results from the attention process after {timeout_s:g} s "
              "(--timeout)", file=sys.stderr)  # fmt: skip
    for p in procs:
        p.kill()
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    p.add_argument("--hidden", type=int, nargs="+", default=[2048, 7168])
    p.add_argument("--iters", type=int, default=300, help="timed iterations")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument(
        "--no-pin", dest="pin", action="store_false",
        help="do not pin each role to its own CPU core",
    )  # fmt: skip
    p.add_argument(
        "--backend", choices=("auto", "nccl", "cuda_ipc", "gloo"), default="auto",
        help="the connector's data plane (connector_extra_config.backend)",
    )  # fmt: skip
    p.add_argument(
        "--ipc-copy", choices=("ce", "sm"), default="ce",
        help="cuda_ipc: copy engine copy + flag kernel, or one SM kernel",
    )  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument(
        "--timeout", type=float, default=3600.0,
        help="seconds to wait for the whole run (default 3600)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        p.error(f"--dtype {args.dtype} is not a torch dtype (e.g. bfloat16)")
    # The raw baseline: send/recv on the backend's own process group, or, where
    # NCCL cannot pair the roles (one GPU), the device copy a round trip is.
    args.raw = "group"
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        if args.backend != "cuda_ipc":
            print("--device cuda needs 2 GPUs, or --backend cuda_ipc (both roles "
                  "on one GPU; start MPS first)", file=sys.stderr)  # fmt: skip
            return 2
        args.raw = "copy"
    ctx = mp.get_context("spawn")
    port = _free_port()
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_ffn, args=(args, port)),
        ctx.Process(target=_attention, args=(args, port, q)),
    ]
    for proc in procs:
        proc.start()
    rows = _results(q, procs, args.timeout)
    if rows is None:
        return 1
    for proc in procs:
        proc.join(60)
    raw = "device copy there and back" if args.raw == "copy" else "send/recv"
    print(f"A2F+F2A round trip, {args.device}, {args.dtype}, backend "
          f"{args.backend} (ipc_copy {args.ipc_copy}), raw = {raw}, median of "
          f"{args.iters} iterations, raw and connector interleaved")  # fmt: skip
    print(_table(rows))
    ratios = [r["ratio"] for r in rows]
    print(f"ratio connector/raw: median {statistics.median(ratios):.3f}, "
          f"max {max(ratios):.3f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
