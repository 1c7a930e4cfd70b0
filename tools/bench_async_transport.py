"""Benchmark: the async connector's round trip against the p2p connector's.

Two processes (attention rank 0 here, FFN rank 0 a child), 1A1F, CPU, gate on
attention on both. For every token count the attention side times one MoE
layer's exchange, routing included, while the FFN side echoes the rows:

* ``async``: ``AsyncAttention.exchange`` (a work-item frame over its TCP
  connection, the FFN's receiving thread, a reply frame);
* ``p2p``: ``send_a2f`` + ``recv_f2a`` (Gloo tagged send/recv, one step plan
  per ``LAYERS`` layers, as in serving).

Medians of ``--iters`` round trips per size, and the ratio async / p2p.
Each role is pinned to its own core unless ``--no-pin``.

    python tools/bench_async_transport.py
    python tools/bench_async_transport.py --hidden 2048 --tokens 1,16,256,2048
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import threading
import time
from typing import Any

import torch

from vllm_afd.config import parse_afd_config
from vllm_afd.connector import ExecMode, Fingerprint, Routing, StepPlan
from vllm_afd.connector.factory import create_async_endpoint, create_connector

LAYERS = 16
TOP_K = 4
EXPERTS = 16


def _free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65000:
            return port


def _fp(hidden: int, connector: str) -> Fingerprint:
    return Fingerprint(
        arch="Bench", hidden_size=hidden, dtype="float32", num_layers=LAYERS,
        moe_layers=tuple(range(LAYERS)), num_experts=EXPERTS, top_k=TOP_K,
        num_attention_ranks=1, num_ffn_ranks=1, compute_gate_on_attention=True,
        connector=connector, remote_layers=tuple(range(LAYERS)),
    )  # fmt: skip


def _config(role: str, connector: str, port: int):
    return parse_afd_config({
        "role": role, "connector": connector, "port": port,
        "compute_gate_on_attention": True,
        "connector_extra_config": {"timeout_s": 60.0},
    })  # fmt: skip


def _pin(core: int | None) -> None:
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)


def _ffn(connector: str, port: int, hidden: int, core: int | None) -> None:
    _pin(core)
    fp = _fp(hidden, connector)
    config = _config("ffn", connector, port)
    if connector == "async":
        ep = create_async_endpoint(config, 0, fp)
        ep.start()
        while (item := ep.next_item()) is not None:
            ep.reply(item, item.hidden)
        ep.close()
        return
    conn = create_connector(config, 0, fp)
    conn.start()
    while (plan := conn.recv_plan()) is not None:
        for layer in range(LAYERS):
            if plan.num_tokens:
                batch = conn.recv_a2f(layer, 0)
                conn.send_f2a(layer, 0, batch.hidden)
    conn.close()


def _routing(tokens: int) -> Routing:
    ids = torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(tokens)])
    return Routing(torch.rand(tokens, TOP_K), ids.to(torch.int32))


def _measure(connector: str, hidden: int, sizes: list[int], iters: int, pin: bool):
    port = _free_port()
    ctx = mp.get_context("forkserver")
    child = ctx.Process(target=_ffn, args=(connector, port, hidden, 1 if pin else None))
    child.start()
    _pin(0 if pin else None)
    fp = _fp(hidden, connector)
    config = _config("attention", connector, port)
    out: dict[int, float] = {}
    if connector == "async":
        ep = create_async_endpoint(config, 0, fp)
        ep.start()
        for t in sizes:
            hidden_t, routing = torch.randn(t, hidden), _routing(t)
            times = []
            for i in range(iters + 5):
                start = time.perf_counter()
                ep.exchange(i % LAYERS, hidden_t, routing, 1, False, 60.0)
                times.append(time.perf_counter() - start)
            out[t] = statistics.median(times[5:])
        ep.close()
    else:
        conn = create_connector(config, 0, fp)
        conn.start()
        step = 0
        for t in sizes:
            hidden_t, routing = torch.randn(t, hidden), _routing(t)
            times = []
            while len(times) < iters + 5:  # whole steps of LAYERS layers
                step += 1
                conn.send_plan(StepPlan(step, ExecMode.EAGER, (t,)))
                for layer in range(LAYERS):
                    start = time.perf_counter()
                    conn.send_a2f(layer, 0, hidden_t, routing)
                    conn.recv_f2a(layer, 0)
                    times.append(time.perf_counter() - start)
            out[t] = statistics.median(times[5:])
        conn.close()
    child.join(30)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--tokens", default="1,16,256,2048")
    p.add_argument("--iters", type=int, default=64)
    p.add_argument("--no-pin", action="store_true")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    sizes = [int(t) for t in args.tokens.split(",")]
    pin = not args.no_pin and (os.cpu_count() or 1) >= 2
    rows: list[dict[str, Any]] = []
    got = {
        c: _measure(c, args.hidden, sizes, args.iters, pin) for c in ("async", "p2p")
    }
    print(f"hidden {args.hidden}, fp32, top-{TOP_K} routing, 1A1F, medians of "
          f"{args.iters} round trips")  # fmt: skip
    print(f"{'tokens':>7} {'async us':>10} {'p2p us':>10} {'async/p2p':>10}")
    for t in sizes:
        a, b = got["async"][t], got["p2p"][t]
        rows.append({"tokens": t, "async_us": a * 1e6, "p2p_us": b * 1e6})
        print(f"{t:>7} {a * 1e6:>10.1f} {b * 1e6:>10.1f} {a / b:>9.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hidden": args.hidden, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    threading.current_thread().name = "attention"
    main()
