"""Endpoint programs and a runner for the connector contract suite.

Each endpoint is a plain function of a picklable ``Scenario``: the runner
starts them as threads (``loopback``) or forkserver processes (``p2p``) and
returns one outcome per endpoint: ``{"ok": ...}``, ``{"error": type name,
"message": ..., "elapsed": s}`` or ``{"killed": True}``.

Dimensions: T tokens, H hidden size, K top-k.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from vllm_afd.config import AFDRole, parse_afd_config
from vllm_afd.connector import (
    ExchangeLimits,
    ExecMode,
    Fingerprint,
    Routing,
    StepPlan,
    create_connector,
)
from vllm_afd.errors import AFDError

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Scenario:
    """What every endpoint of one run does."""

    connector: str
    port: int
    num_attention: int
    num_ffn: int
    num_ubatches: int = 1
    steps: int = 3
    layers: int = 3
    hidden: int = 16
    top_k: int = 2
    dtype: str = "float32"
    gate_on_attention: bool = False
    zero_ranks: tuple[int, ...] = ()  # attention ranks with 0 tokens on odd steps
    timeout_s: float = 10.0
    connect_timeout_s: float = 30.0
    device: str = "cpu"  # "cuda": endpoint i uses cuda:i (NCCL data plane)
    # (role, rank, step, layer): that endpoint dies there (SIGKILL / thread exit).
    die_at: tuple[str, int, int, int] | None = None
    # FFN ranks close after this many steps (shutdown from the FFN side).
    ffn_stop_after: int | None = None
    # (role, rank) -> fingerprint field overrides (mismatch tests).
    fp_override: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    # more connector_extra_config keys of every endpoint (e.g. backend)
    options: dict[str, Any] = field(default_factory=dict)


def fingerprint(sc: Scenario, role: str, rank: int) -> Fingerprint:
    fp = Fingerprint(
        arch="TinyMoE",
        hidden_size=sc.hidden,
        dtype=sc.dtype,
        num_layers=sc.layers,
        moe_layers=tuple(range(sc.layers)),
        num_experts=8,
        top_k=sc.top_k,
        num_attention_ranks=sc.num_attention,
        num_ffn_ranks=sc.num_ffn,
        compute_gate_on_attention=sc.gate_on_attention,
        connector=sc.connector,
    )
    return replace(fp, **sc.fp_override.get((role, rank), {}))


def tokens(sc: Scenario, step: int, rank: int) -> tuple[int, ...]:
    if rank in sc.zero_ranks and step % 2 == 1:
        return (0,) * sc.num_ubatches
    return tuple(1 + (7 * step + 3 * rank + 5 * u) % 9 for u in range(sc.num_ubatches))


def make_input(
    sc: Scenario, step: int, rank: int, layer: int, ub: int, n: int
) -> tuple[torch.Tensor, Routing | None]:
    g = torch.Generator().manual_seed(((step * 31 + rank) * 31 + layer) * 31 + ub)
    dev = torch.device("cpu") if sc.device == "cpu" else torch.device("cuda")
    hidden = torch.randn(n, sc.hidden, generator=g).to(dev, getattr(torch, sc.dtype))
    if not sc.gate_on_attention:
        return hidden, None
    w = torch.rand(n, sc.top_k, generator=g, dtype=torch.float32)
    ids = torch.randint(0, 8, (n, sc.top_k), generator=g, dtype=torch.int32)
    return hidden, Routing(w.to(dev), ids.to(dev))


def ffn_fn(hidden: torch.Tensor, routing: Routing | None, layer: int) -> torch.Tensor:
    """Row-wise, so merged and per-peer results are bit-identical."""
    out = hidden * 2 + layer
    if routing is not None:
        extra = routing.topk_weights.sum(-1, keepdim=True) + routing.topk_ids.sum(
            -1, keepdim=True
        )
        out = out + extra.to(hidden.dtype)
    return out


def _die(sc: Scenario, role: str, rank: int, step: int, layer: int) -> bool:
    return sc.die_at == (role, rank, step, layer)


class _Died(Exception):
    """A thread endpoint 'dies': it leaves without close()."""


def _kill_self(threaded: bool) -> None:
    if threaded:
        raise _Died
    os.kill(os.getpid(), signal.SIGKILL)


def _connector(sc: Scenario, role: str, rank: int, **options: Any):
    """The endpoint ``role`` rank ``rank`` of ``sc``; ``options`` are more
    ``connector_extra_config`` keys (e.g. ``secret_file``)."""
    cfg = parse_afd_config(
        {
            "role": role,
            "connector": sc.connector,
            "host": "127.0.0.1",
            "port": sc.port,
            "num_attention_ranks": sc.num_attention,
            "num_ffn_ranks": sc.num_ffn,
            "compute_gate_on_attention": sc.gate_on_attention,
            **({"rank": rank} if role == "ffn" else {}),
            "connector_extra_config": {
                "timeout_s": sc.timeout_s,
                # the first served step too: a lost message fails the run
                # within timeout_s, naming what was waited for
                "warmup_timeout_s": sc.timeout_s,
                "connect_timeout_s": sc.connect_timeout_s,
                **sc.options,
                **options,
            },
        }
    )
    limits = ExchangeLimits(max_tokens=64, ubatches=sc.num_ubatches)
    return create_connector(
        cfg, rank, fingerprint(sc, role, rank), _device(sc, role, rank), limits
    )


def _device(sc: Scenario, role: str, rank: int) -> torch.device:
    if sc.device == "cpu":
        return torch.device("cpu")
    index = endpoints(sc).index((role, rank)) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def attention(sc: Scenario, rank: int, threaded: bool) -> dict[str, Any]:
    conn = _connector(sc, "attention", rank)
    assert conn.role is AFDRole.ATTENTION and conn.role_rank == rank
    conn.start()
    checked = 0
    for step in range(sc.steps):
        toks = tokens(sc, step, rank)
        conn.send_plan(StepPlan(step, ExecMode.EAGER, toks))
        for layer in range(sc.layers):
            sent = []
            for ub in range(sc.num_ubatches):
                hidden, routing = make_input(sc, step, rank, layer, ub, toks[ub])
                sent.append(
                    (hidden, routing, conn.send_a2f(layer, ub, hidden, routing))
                )
            if _die(sc, "attention", rank, step, layer):
                _kill_self(threaded)
            handles = [conn.irecv_f2a(layer, ub) for ub in range(sc.num_ubatches)]
            for ub, (hidden, routing, h) in enumerate(sent):
                out = handles[ub].wait()
                h.wait()
                want = ffn_fn(hidden, routing, layer)
                if not torch.equal(out, want):
                    raise AssertionError(f"step {step} layer {layer} ubatch {ub}")
                checked += out.shape[0]
    stats = conn.stats
    conn.close()
    conn.close()  # idempotent
    return {"ok": True, "rows": checked, "steps": stats.steps}


def ffn(sc: Scenario, rank: int, threaded: bool) -> dict[str, Any]:
    conn = _connector(sc, "ffn", rank)
    conn.start()
    steps = 0
    while (plan := conn.recv_plan()) is not None:
        for layer in range(sc.layers):
            for ub in range(plan.num_ubatches):
                batch = conn.recv_a2f(layer, ub)
                assert batch.hidden.shape[0] == plan.ubatch_tokens[ub]
                if _die(sc, "ffn", rank, plan.step_id, layer):
                    _kill_self(threaded)
                conn.send_f2a(layer, ub, ffn_fn(batch.hidden, batch.routing, layer))
        steps += 1
        if sc.ffn_stop_after is not None and steps >= sc.ffn_stop_after:
            break
    stats = conn.stats
    conn.close()
    return {"ok": True, "steps": steps, "stats_steps": stats.steps}


def _outcome(role: str, rank: int, sc: Scenario, threaded: bool) -> dict[str, Any]:
    t0 = time.monotonic()
    fn = attention if role == "attention" else ffn
    try:
        return fn(sc, rank, threaded)
    except _Died:
        return {"killed": True}
    except AFDError as e:
        return {
            "error": type(e).__name__,
            "message": str(e),
            "elapsed": time.monotonic() - t0,
        }
    except BaseException as e:  # a test bug: report it with its traceback
        return {"error": type(e).__name__, "message": traceback.format_exc()}


def _proc_main(role: str, rank: int, sc: Scenario, q: Any) -> None:
    q.put(((role, rank), _outcome(role, rank, sc, threaded=False)))


def endpoints(sc: Scenario) -> list[tuple[str, int]]:
    return [("ffn", k) for k in range(sc.num_ffn)] + [
        ("attention", a) for a in range(sc.num_attention)
    ]


_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        if HERE not in sys.path:
            sys.path.insert(0, HERE)
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "vllm_afd.connector", "_scenarios"])
    return _CTX


def run(sc: Scenario, limit_s: float = 60.0) -> dict[tuple[str, int], dict]:
    """Run every endpoint of ``sc``; threads for loopback, processes otherwise."""
    eps = endpoints(sc)
    results: dict[tuple[str, int], dict] = {}
    if sc.connector == "loopback":
        threads = []
        for role, rank in eps:

            def body(role: str = role, rank: int = rank) -> None:
                results[(role, rank)] = _outcome(role, rank, sc, threaded=True)

            threads.append(threading.Thread(target=body, daemon=True))
        for t in threads:
            t.start()
        deadline = time.monotonic() + limit_s
        for t in threads:
            t.join(max(deadline - time.monotonic(), 0.1))
        frames = sys._current_frames()
        for ep, t in zip(eps, threads, strict=True):
            if ep not in results:
                frame = frames.get(t.ident) if t.ident is not None else None
                stack = "".join(traceback.format_stack(frame)) if frame else ""
                results[ep] = {"hung": True, "stack": stack}
        return results
    ctx = _context()
    q = ctx.Queue()
    procs = {ep: ctx.Process(target=_proc_main, args=(*ep, sc, q)) for ep in eps}
    for p in procs.values():
        p.start()
    deadline = time.monotonic() + limit_s
    while len(results) < len(eps) and time.monotonic() < deadline:
        try:
            ep, out = q.get(timeout=0.2)
            results[ep] = out
        except Exception:  # queue.Empty: check for dead processes
            if all(not p.is_alive() for p in procs.values()) and q.empty():
                break
    for ep, p in procs.items():
        p.join(0.5 if ep in results else 0)
        if p.is_alive():
            p.kill()
            p.join()
            results.setdefault(ep, {"hung": True})
        elif ep not in results:
            results[ep] = {"killed": p.exitcode == -signal.SIGKILL, "rc": p.exitcode}
    return results


def run_processes(
    target: Any, arglists: list[tuple], limit_s: float = 120.0
) -> dict[Any, dict]:
    """One process of ``target(*args, q)`` per entry of ``arglists``; what
    each puts on ``q`` as ``(key, outcome)``, by key. A process still alive
    at the end is killed."""
    ctx = _context()
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, q)) for args in arglists]
    for p in procs:
        p.start()
    out: dict[Any, dict] = {}
    try:
        while len(out) < len(procs):
            key, result = q.get(timeout=limit_s)
            out[key] = result
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return out


def free_port() -> int:
    """A port P such that P and P+1 are both free now."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65535:
            continue
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
