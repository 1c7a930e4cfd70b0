"""Benchmark: the ``async`` connector's payload planes side by side, each
against ``socket``.

Two processes on this host: an attention rank and an FFN rank (1A1F), each
holding one endpoint of the ``async`` connector per payload plane, one
session per plane on ports of their own. For every (tokens, hidden) the
attention rank times :meth:`exchange` of one work item (all rows to the one
FFN rank, top-2 routing) until its reply is added (on a GPU: until the
device finished it); the FFN rank answers with the rows as they came, moved
to its device (no expert compute, so the figure is the transport). The
planes take turns every iteration, in an order that rotates; medians are
reported, with each plane's ratio to ``socket``. Each process runs one torch
thread, pinned to a core of its own.

    python tools/bench_async_payload.py
    python tools/bench_async_payload.py --tokens 64 2048 --hidden 2048 --iters 50
    python tools/bench_async_payload.py --device cuda   # socket, shared, cuda_ipc

With ``--device cuda`` both processes use GPU 0 (start the MPS daemon first
to let them run side by side, as a deployment on one GPU would).

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
from vllm_afd.connector.factory import (
    ASYNC_PAYLOADS,
    ExchangeLimits,
    create_async_endpoint,
)

#: the planes each device compares by default
DEFAULT_PAYLOADS = {
    "cpu": ("socket", "shared"),
    "cuda": ASYNC_PAYLOADS,
}
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
    device = torch.device(args.device)
    return create_async_endpoint(parse_afd_config(raw), 0, fp, limits, device)


def _serve(ep, device: torch.device) -> None:
    ep.start()
    while (item := ep.next_item()) is not None:
        ep.reply(item, item.hidden.to(device))


def _pin(core: int) -> None:
    """One torch thread on one core of its own (as a role's worker binds its
    OpenMP threads): two processes of idle OpenMP threads spinning on shared
    cores would time the scheduler, not the planes."""
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[core % len(cores)]})


def _ffn(args: Any, ports: dict[tuple[str, int], int]) -> None:
    _pin(1)
    device = torch.device(args.device)
    threads = [
        threading.Thread(
            target=_serve, args=(_endpoint("ffn", port, p, h, args), device)
        )
        for (p, h), port in ports.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _attention(args: Any, ports: dict[tuple[str, int], int], q: Any) -> None:
    _pin(0)
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    planes = args.payloads
    eps = {key: _endpoint("attention", port, *key, args) for key, port in ports.items()}
    for ep in eps.values():
        ep.start()
    rows = []
    for hidden in args.hidden:
        for tokens in args.tokens:
            x = torch.randn(tokens, hidden).to(device, dtype)
            ids = torch.randint(0, EXPERTS, (tokens, K), dtype=torch.int32)
            routing = Routing(torch.rand(tokens, K), ids).to(device)
            times: dict[str, list[float]] = {p: [] for p in planes}
            for i in range(args.warmup + args.iters):
                turn = i % len(planes)
                for p in planes[turn:] + planes[:turn]:
                    t0 = time.perf_counter()
                    eps[(p, hidden)].exchange(0, x, routing, 1, False, 120.0)
                    if cuda:
                        torch.cuda.synchronize(device)
                    if i >= args.warmup:
                        times[p].append(time.perf_counter() - t0)
            med = {p: statistics.median(times[p]) * 1e6 for p in planes}
            rows.append((tokens, hidden, med))
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
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--payloads",
        type=lambda s: tuple(s.split(",")),
        default=None,
        help="comma-separated planes, socket first (default: socket,shared; "
        "with --device cuda also cuda_ipc)",
    )
    args = p.parse_args(argv)
    if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        p.error(f"--dtype {args.dtype} is not a torch dtype (e.g. bfloat16)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU is visible")
    args.payloads = args.payloads or DEFAULT_PAYLOADS[args.device]
    if args.payloads[0] != "socket" or not set(args.payloads) <= set(ASYNC_PAYLOADS):
        p.error(
            f"--payloads {','.join(args.payloads)}: socket first (the baseline), "
            f"then any of {', '.join(ASYNC_PAYLOADS[1:])}"
        )
    if "cuda_ipc" in args.payloads and args.device != "cuda":
        p.error("--payloads cuda_ipc needs --device cuda")
    ports = {(pl, h): _free_port() for pl in args.payloads for h in args.hidden}
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
        f"async exchange (1A1F, {args.dtype} on {args.device}, work item and "
        f"reply), median of {args.iters} iterations, planes interleaved"
    )
    others = args.payloads[1:]
    print(
        "| T | H | "
        + " | ".join(f"{p} µs" for p in args.payloads)
        + "".join(f" | {p} / socket" for p in others)
        + " |"
    )
    print("|---:|---:|" + "---:|" * (len(args.payloads) + len(others)))
    for tokens, hidden, med in rows:
        cells = [f"{med[p]:.0f}" for p in args.payloads]
        cells += [f"{med[p] / med['socket']:.2f}" for p in others]
        print(f"| {tokens} | {hidden} | " + " | ".join(cells) + " |")
    for p in others:
        ratios = [med[p] / med["socket"] for _, _, med in rows]
        print(f"ratio {p}/socket: median {statistics.median(ratios):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
