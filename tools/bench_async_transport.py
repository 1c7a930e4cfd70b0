"""Benchmark: the async connector's round trip, phase by phase, against the
p2p connector's.

Attention rank 0 runs here, each FFN rank in a child process, on the CPU,
gate on attention. For every token count the attention side times one MoE
layer's exchange, routing included, while each FFN rank echoes the rows it
got (trivial work, so the figures are the transport's):

* ``async``: ``AsyncAttention.exchange`` (a work-item frame to each FFN rank
  owning experts of the rows, over its TCP connection; the FFN's receiving
  thread; a reply frame; the combine). ``--ffn-ranks`` FFN ranks split the
  ``--experts`` experts.
* ``p2p``: ``send_a2f`` + ``recv_f2a`` (Gloo tagged send/recv, one step plan
  per ``LAYERS`` layers, as in serving); 1A1F only.

Medians of ``--iters`` round trips per size, the ratio async / p2p, and with
``--breakdown`` the async exchange's median phases on the attention side:

* ``group``: ``_dispatch`` less its socket sends: which rows go where, their
  ids and weights, the per-expert counts, the packed rows (and on a GPU the
  copies to host memory);
* ``send``: the socket writes of the work items (the FFN ranks read them as
  they come);
* ``wait``: ``_collect``, until every reply is read;
* ``combine``: the replies added into the output;

and ``cpu``, the attention thread's CPU time in the whole exchange (user and
system: page faults and socket copies included, the waits not), which the
FFN ranks sharing the machine's cores disturb less than the wall times.

Each role is pinned to a core unless ``--no-pin`` (attention on core 0, the
FFN ranks on core 1, round-robin over the others on larger machines). The
attention process runs torch with ``--threads`` CPU threads (default 1, as
vLLM's worker processes do unless ``OMP_NUM_THREADS`` says otherwise).

    python tools/bench_async_transport.py
    python tools/bench_async_transport.py --hidden 2048 --tokens 1,16,256,2048
    python tools/bench_async_transport.py --connectors async --breakdown \\
        --experts 128 --top-k 8 --ffn-ranks 2 --tokens 256,2048,8192
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_afd.config import parse_afd_config
from vllm_afd.connector import ExecMode, Fingerprint, Routing, StepPlan, async_ep
from vllm_afd.connector.factory import create_async_endpoint, create_connector

LAYERS = 16
PHASES = ("group", "send", "wait", "combine")
#: the breakdown's columns: the phases, then the attention thread's CPU time
COLUMNS = (*PHASES, "cpu")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Shape:
    """What one benchmark run exchanges."""

    hidden: int
    experts: int
    top_k: int
    ffn_ranks: int
    dtype: str


def _free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65000:
            return port


def _fp(shape: Shape, connector: str) -> Fingerprint:
    return Fingerprint(
        arch="Bench", hidden_size=shape.hidden, dtype=shape.dtype,
        num_layers=LAYERS, moe_layers=tuple(range(LAYERS)),
        num_experts=shape.experts, top_k=shape.top_k, num_attention_ranks=1,
        num_ffn_ranks=shape.ffn_ranks, compute_gate_on_attention=True,
        connector=connector, remote_layers=tuple(range(LAYERS)),
    )  # fmt: skip


def _config(role: str, connector: str, port: int, shape: Shape, rank: int = 0):
    raw: dict[str, Any] = {
        "role": role, "connector": connector, "port": port,
        "num_ffn_ranks": shape.ffn_ranks, "compute_gate_on_attention": True,
        "connector_extra_config": {"timeout_s": 60.0},
    }  # fmt: skip
    if role == "ffn":
        raw["rank"] = rank
    return parse_afd_config(raw)


def _pin(core: int | None, threads: int = 1) -> None:
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    torch.set_num_threads(threads)


def _ffn(connector: str, port: int, shape: Shape, rank: int, core: int | None):
    _pin(core)
    fp = _fp(shape, connector)
    config = _config("ffn", connector, port, shape, rank)
    if connector == "async":
        ep = create_async_endpoint(config, rank, fp)
        ep.start()
        while (item := ep.next_item()) is not None:
            ep.reply(item, item.hidden)
        ep.close()
        return
    conn = create_connector(config, rank, fp)
    conn.start()
    while (plan := conn.recv_plan()) is not None:
        for layer in range(LAYERS):
            if plan.num_tokens:
                batch = conn.recv_a2f(layer, 0)
                conn.send_f2a(layer, 0, batch.hidden)
    conn.close()


def _inputs(tokens: int, shape: Shape) -> tuple[torch.Tensor, Routing]:
    """Rows and a near-uniform top-k of distinct experts (dummy weights
    route about so), seeded."""
    g = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, shape.hidden, generator=g)
    ids = torch.rand(tokens, shape.experts, generator=g).topk(shape.top_k).indices
    weights = torch.rand(tokens, shape.top_k, generator=g)
    return hidden.to(DTYPES[shape.dtype]), Routing(weights, ids.to(torch.int32))


class _Phases:
    """Times the phases of each exchange of ``ep`` (see the module
    docstring) by wrapping its methods, its links' sends and the module's
    combine; :meth:`take` returns and clears one exchange's figures."""

    def __init__(self, ep: async_ep.AsyncAttention) -> None:
        self.now: dict[str, float] = dict.fromkeys(("dispatch", *PHASES), 0.0)
        ep._dispatch = self._timed("dispatch", ep._dispatch)  # type: ignore[method-assign]
        ep._collect = self._timed("wait", ep._collect)  # type: ignore[method-assign]
        for link in ep.links:
            link.send = self._timed("send", link.send)  # type: ignore[method-assign]
        self._combine = async_ep.combine
        async_ep.combine = self._timed("combine", async_ep.combine)

    def _timed(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[phase] += time.perf_counter() - start

        return timed

    def take(self) -> dict[str, float]:
        got = dict(self.now)
        got["group"] = got.pop("dispatch") - got["send"]
        self.now = dict.fromkeys(self.now, 0.0)
        return got

    def restore(self) -> None:
        async_ep.combine = self._combine


def _measure(
    connector: str, shape: Shape, sizes: list[int], iters: int, warmup: int,
    pin: bool, threads: int, breakdown: bool,
) -> dict[int, dict[str, float]]:  # fmt: skip
    """``{tokens: {"total": s, phase: s, ...}}``: medians over ``iters``."""
    port = _free_port()
    ctx = mp.get_context("forkserver")
    cores = os.cpu_count() or 1
    children = [
        ctx.Process(
            target=_ffn,
            args=(
                connector,
                port,
                shape,
                r,
                1 + r % max(cores - 1, 1) if pin else None,
            ),
        )
        for r in range(shape.ffn_ranks)
    ]
    for child in children:
        child.start()
    _pin(0 if pin else None, threads)
    fp = _fp(shape, connector)
    config = _config("attention", connector, port, shape)
    out: dict[int, dict[str, float]] = {}
    if connector == "async":
        ep = create_async_endpoint(config, 0, fp)
        assert isinstance(ep, async_ep.AsyncAttention)
        ep.start()
        phases = _Phases(ep) if breakdown else None
        for t in sizes:
            hidden_t, routing = _inputs(t, shape)
            runs: list[dict[str, float]] = []
            for i in range(iters + warmup):
                start, cpu = time.perf_counter(), time.thread_time()
                ep.exchange(i % LAYERS, hidden_t, routing, 1, False, 60.0)
                took = {
                    "total": time.perf_counter() - start,
                    "cpu": time.thread_time() - cpu,
                }
                if phases is not None:
                    took.update(phases.take())
                runs.append(took)
            out[t] = {k: statistics.median(r[k] for r in runs[warmup:]) for k in took}
        if phases is not None:
            phases.restore()
        ep.close()
    else:
        conn = create_connector(config, 0, fp)
        conn.start()
        step = 0
        for t in sizes:
            hidden_t, routing = _inputs(t, shape)
            times: list[float] = []
            while len(times) < iters + warmup:  # whole steps of LAYERS layers
                step += 1
                conn.send_plan(StepPlan(step, ExecMode.EAGER, (t,)))
                for layer in range(LAYERS):
                    start = time.perf_counter()
                    conn.send_a2f(layer, 0, hidden_t, routing)
                    conn.recv_f2a(layer, 0)
                    times.append(time.perf_counter() - start)
            out[t] = {"total": statistics.median(times[warmup:])}
        conn.close()
    for child in children:
        child.join(30)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--tokens", default="1,16,256,2048")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--ffn-ranks", type=int, default=1, help="async only")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--connectors", default="async,p2p")
    p.add_argument("--iters", type=int, default=64)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads on attention"
    )
    p.add_argument("--breakdown", action="store_true", help="async phases")
    p.add_argument("--no-pin", action="store_true")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    sizes = [int(t) for t in args.tokens.split(",")]
    shape = Shape(args.hidden, args.experts, args.top_k, args.ffn_ranks, args.dtype)
    connectors = args.connectors.split(",")
    if shape.ffn_ranks > 1 and "p2p" in connectors:
        p.error("p2p needs as many attention ranks as FFN ranks: --connectors async")
    pin = not args.no_pin and (os.cpu_count() or 1) >= 2
    got = {
        c: _measure(
            c,
            shape,
            sizes,
            args.iters,
            args.warmup,
            pin,
            args.threads,
            args.breakdown,
        )  # fmt: skip
        for c in connectors
    }
    print(
        f"hidden {shape.hidden}, {shape.dtype}, {shape.experts} experts top-"
        f"{shape.top_k}, 1A{shape.ffn_ranks}F, torch threads {args.threads}, "
        f"medians of {args.iters} round trips"
    )
    head = f"{'tokens':>7}" + "".join(f" {c + ' us':>10}" for c in connectors)
    if len(connectors) == 2:
        head += f" {'/'.join(connectors):>10}"
    if args.breakdown and "async" in connectors:
        head += "".join(f" {ph + ' us':>10}" for ph in COLUMNS)
    print(head)
    rows: list[dict[str, Any]] = []
    for t in sizes:
        row: dict[str, Any] = {"tokens": t}
        line = f"{t:>7}"
        for c in connectors:
            row[f"{c}_us"] = got[c][t]["total"] * 1e6
            line += f" {row[f'{c}_us']:>10.1f}"
        if len(connectors) == 2:
            a, b = (got[c][t]["total"] for c in connectors)
            line += f" {a / b:>9.2f}x"
        if args.breakdown and "async" in connectors:
            for ph in COLUMNS:
                row[f"{ph}_us"] = got["async"][t][ph] * 1e6
                line += f" {row[f'{ph}_us']:>10.1f}"
        rows.append(row)
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": vars(shape), "threads": args.threads, "rows": rows},
                      f, indent=2)  # fmt: skip


if __name__ == "__main__":
    threading.current_thread().name = "attention"
    main()
