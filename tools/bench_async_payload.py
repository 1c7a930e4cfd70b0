"""Benchmark: the ``async`` connector's payload planes, ``shared`` against
``socket``, side by side.

Two processes on this host: an attention rank and an FFN rank (1A1F), each
holding two endpoints of the ``async`` connector, one session per payload
plane on ports of their own. For every (tokens, hidden) the attention rank
times :meth:`exchange` of one work item (all rows to the one FFN rank, top-2
routing) until its reply is added; the FFN rank answers with the rows as they
came (no expert compute, so the figure is the transport). The two planes
alternate every iteration, and so does which goes first; medians are
reported, with the ratio ``shared / socket``. Each process runs one torch
thread, pinned to a core of its own.

    python tools/bench_async_payload.py
    python tools/bench_async_payload.py --tokens 64 2048 --hidden 2048 --iters 50

Dimensions: T tokens, H hidden size.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import threading
import time
from typing import Any

import torch

from vllm_afd.config import parse_afd_config
from vllm_afd.connector import Fingerprint, Routing
from vllm_afd.connector.factory import ExchangeLimits, create_async_endpoint

PAYLOADS = ("socket", "shared")
K, EXPERTS = 2, 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _endpoint(role: str, port: int, payload: str, hidden: int, args: Any):
    raw = {
        "role": role, "connector": "async", "port": port,
        "num_attention_ranks": 1, "num_ffn_ranks": 1,
        "connector_extra_config": {"payload": payload, "timeout_s": 120.0},
    }  # fmt: skip
    if role == "ffn":
        raw["rank"] = 0
    fp = Fingerprint(
        arch="Bench", hidden_size=hidden, dtype=args.dtype, num_layers=1,
        moe_layers=(0,), num_experts=EXPERTS, top_k=K, num_attention_ranks=1,
        num_ffn_ranks=1, compute_gate_on_attention=True, connector="async",
        remote_layers=(0,),
    )  # fmt: skip
    limits = ExchangeLimits(max_tokens=max(args.tokens))
    return create_async_endpoint(parse_afd_config(raw), 0, fp, limits)


def _serve(ep) -> None:
    ep.start()
    while (item := ep.next_item()) is not None:
        ep.reply(item, item.hidden)


def _pin(core: int) -> None:
    """One torch thread on one core of its own (as a role's worker binds its
    OpenMP threads): two processes of idle OpenMP threads spinning on shared
    cores would time the scheduler, not the planes."""
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[core % len(cores)]})


def _ffn(args: Any, ports: dict[tuple[str, int], int]) -> None:
    _pin(1)
    threads = [
        threading.Thread(target=_serve, args=(_endpoint("ffn", port, p, h, args),))
        for (p, h), port in ports.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _attention(args: Any, ports: dict[tuple[str, int], int], q: Any) -> None:
    _pin(0)
    dtype = getattr(torch, args.dtype)
    eps = {key: _endpoint("attention", port, *key, args) for key, port in ports.items()}
    for ep in eps.values():
        ep.start()
    rows = []
    for hidden in args.hidden:
        for tokens in args.tokens:
            x = torch.randn(tokens, hidden).to(dtype)
            ids = torch.randint(0, EXPERTS, (tokens, K), dtype=torch.int32)
            routing = Routing(torch.rand(tokens, K), ids)
            times: dict[str, list[float]] = {p: [] for p in PAYLOADS}
            for i in range(args.warmup + args.iters):
                order = PAYLOADS if i % 2 == 0 else PAYLOADS[::-1]
                for p in order:
                    t0 = time.perf_counter()
                    eps[(p, hidden)].exchange(0, x, routing, 1, False, 120.0)
                    if i >= args.warmup:
                        times[p].append(time.perf_counter() - t0)
            med = {p: statistics.median(times[p]) * 1e6 for p in PAYLOADS}
            rows.append((tokens, hidden, med["socket"], med["shared"]))
    for ep in eps.values():
        ep.close()
    q.put(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 256, 2048])
    p.add_argument("--hidden", type=int, nargs="+", default=[2048])
    p.add_argument("--iters", type=int, default=100, help="timed iterations")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--timeout", type=float, default=1800.0, help="whole run, s")
    args = p.parse_args(argv)
    if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        p.error(f"--dtype {args.dtype} is not a torch dtype (e.g. bfloat16)")
    ports = {(pl, h): _free_port() for pl in PAYLOADS for h in args.hidden}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_ffn, args=(args, ports), daemon=True),
        ctx.Process(target=_attention, args=(args, ports, q), daemon=True),
    ]
    for proc in procs:
        proc.start()
    try:
        rows = q.get(timeout=args.timeout)
    except Exception:
        print(f"no result within {args.timeout:g}s", file=sys.stderr)
        return 1
    for proc in procs:
        proc.join(60)
    print(
        f"async exchange (1A1F, {args.dtype}, work item and reply), median of "
        f"{args.iters} iterations, planes interleaved"
    )
    print("| T | H | socket µs | shared µs | shared / socket |")
    print("|---:|---:|---:|---:|---:|")
    for tokens, hidden, sock, shm in rows:
        print(f"| {tokens} | {hidden} | {sock:.0f} | {shm:.0f} | {shm / sock:.2f} |")
    ratios = [shm / sock for _, _, sock, shm in rows]
    print(f"ratio shared/socket: median {statistics.median(ratios):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
