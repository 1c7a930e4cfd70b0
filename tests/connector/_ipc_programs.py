"""Endpoint programs of the cuda_ipc GPU tests (processes; see test_cuda_ipc)."""

from __future__ import annotations

import faulthandler
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import _scenarios as S
import torch

from vllm_afd.connector import ExecMode, StepPlan
from vllm_afd.errors import AFDError

LAYERS = 3  # the scenario's fingerprint
STEPS = 5
#: replays of the "many" programs (several attention ranks, one FFN rank)
MANY_STEPS = 1000


def _step_tensors(sc: S.Scenario, n: int = 8) -> tuple[torch.Tensor, list]:
    """A step's input [n, H] and one output per layer."""
    x = torch.zeros(n, sc.hidden, device="cuda", dtype=getattr(torch, sc.dtype))
    return x, [torch.empty_like(x) for _ in range(LAYERS)]


def _capture(conn: Any, x: torch.Tensor, outs: list[torch.Tensor]) -> Any:
    """Warm up eagerly, then capture LAYERS round trips in one graph."""
    n = x.shape[0]
    conn.send_plan(StepPlan(0, ExecMode.WARMUP, (n,)))
    for layer in range(LAYERS):
        conn.send_a2f(layer, 0, x)
        conn.recv_f2a(layer, 0, out=outs[layer])
    conn.flush()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    conn.send_plan(StepPlan(1, ExecMode.CAPTURE, (n,)))
    with torch.cuda.graph(graph):
        for layer in range(LAYERS):
            conn.send_a2f(layer, 0, x if layer == 0 else outs[layer - 1])
            conn.recv_f2a(layer, 0, out=outs[layer])
        conn.flush()
    return graph


def _replay_exact(conn: Any, graph: Any, step: int, x: torch.Tensor,
                  outs: list[torch.Tensor]) -> None:  # fmt: skip
    conn.send_plan(StepPlan(step, ExecMode.REPLAY, (x.shape[0],)))
    x.copy_(torch.randn(x.shape).to(x))
    graph.replay()
    torch.cuda.synchronize()
    conn.check()
    want = x
    for layer in range(LAYERS):
        want = S.ffn_fn(want, None, layer)
        if not torch.equal(outs[layer], want):
            raise AssertionError(f"replay {step} layer {layer} differs")


def graph_attention(sc: S.Scenario) -> dict[str, Any]:
    """Capture LAYERS round trips in one CUDA graph, replay with new inputs."""
    conn = S._connector(sc, "attention", 0)
    conn.start()
    x, outs = _step_tensors(sc)
    graph = _capture(conn, x, outs)
    for step in range(2, 2 + STEPS):
        _replay_exact(conn, graph, step, x, outs)
    conn.close()
    return {"ok": True, "replays": STEPS}


def many_attention(sc: S.Scenario, rank: int) -> dict[str, Any]:
    """One of several attention ranks on the GPU: capture LAYERS round trips
    and replay them MANY_STEPS times, each checked (a host sync per step, as
    vLLM's sampler makes)."""
    conn = S._connector(sc, "attention", rank)
    conn.start()
    x, outs = _step_tensors(sc, n=4 + rank)
    graph = _capture(conn, x, outs)
    for step in range(2, 2 + MANY_STEPS):
        _replay_exact(conn, graph, step, x, outs)
    conn.close()
    return {"ok": True, "replays": MANY_STEPS}


def many_ffn(sc: S.Scenario, rank: int = 0) -> dict[str, Any]:
    """The FFN rank of :func:`many_attention`'s ranks: its graph merges them,
    with a matmul per layer that fills the GPU's SMs (as experts do) while
    the peers' waits spin."""
    load = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    return graph_ffn(sc, lambda: torch.mm(load, load))


def graph_ffn(sc: S.Scenario, work: Callable[[], Any] | None = None) -> dict[str, Any]:
    conn = S._connector(sc, "ffn", 0)
    conn.start()
    plan = conn.recv_plan()
    assert plan is not None and plan.mode is ExecMode.WARMUP
    _serve_step(conn)
    plan = conn.recv_plan()
    assert plan is not None and plan.mode is ExecMode.CAPTURE
    if work is not None:
        work()  # its library handles are made before the capture
        torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(LAYERS):
            batch = conn.recv_a2f(layer, 0)
            if work is not None:
                work()
            conn.send_f2a(layer, 0, S.ffn_fn(batch.hidden, None, layer))
        conn.flush()
    replays = 0
    while (plan := conn.recv_plan()) is not None:
        graph.replay()
        replays += 1
    torch.cuda.synchronize()
    conn.close()
    return {"ok": True, "replays": replays}


def desync_attention(sc: S.Scenario) -> dict[str, Any]:
    """Sends layer 1 where the FFN rank waits for layer 0: it fails and
    poisons its answer, so this side fails in the same step."""
    conn = S._connector(sc, "attention", 0)
    conn.start()
    x = torch.ones(4, sc.hidden, device="cuda", dtype=getattr(torch, sc.dtype))
    conn.send_plan(StepPlan(0, ExecMode.EAGER, (4,)))
    conn.send_a2f(1, 0, x)
    conn.recv_f2a(1, 0)
    torch.cuda.synchronize()
    try:
        conn.check()
    except AFDError as e:
        return {"ok": True, "error": type(e).__name__, "message": str(e)}
    finally:
        conn.close()
    return {"ok": False, "message": "no error after a desynchronised exchange"}


def desync_ffn(sc: S.Scenario) -> dict[str, Any]:
    conn = S._connector(sc, "ffn", 0)
    conn.start()
    conn.recv_plan()
    batch = conn.recv_a2f(0, 0)
    conn.send_f2a(0, 0, batch.hidden)
    torch.cuda.synchronize()
    try:
        conn.recv_plan()
    except AFDError as e:
        return {"ok": True, "error": type(e).__name__, "message": str(e)}
    finally:
        conn.close()
    return {"ok": False, "message": "no error after a desynchronised exchange"}


def timeout_attention(sc: S.Scenario) -> dict[str, Any]:
    """The FFN rank never answers: the device-side wait ends after timeout_s."""
    conn = S._connector(sc, "attention", 0)
    conn.start()
    x = torch.ones(4, sc.hidden, device="cuda", dtype=getattr(torch, sc.dtype))
    conn.send_plan(StepPlan(0, ExecMode.EAGER, (4,)))
    conn.send_a2f(0, 0, x)
    t0 = time.monotonic()
    conn.recv_f2a(0, 0)
    torch.cuda.synchronize()
    waited = time.monotonic() - t0
    try:
        conn.check()
    except AFDError as e:
        return {"ok": True, "error": type(e).__name__, "message": str(e),
                "waited": waited}  # fmt: skip
    finally:
        conn.close()
    return {"ok": False, "message": "no error after the wait timed out"}


def silent_ffn(sc: S.Scenario) -> dict[str, Any]:
    conn = S._connector(sc, "ffn", 0)
    conn.start()
    conn.recv_plan()
    conn.recv_a2f(0, 0)  # and never answer
    torch.cuda.synchronize()
    time.sleep(sc.timeout_s + 2)
    conn.close()
    return {"ok": True}


def rejoin_attention(sc: S.Scenario) -> dict[str, Any]:
    """The FFN process dies during a graph replay; a new one takes its place
    and the graph captured with the first keeps replaying, exact."""
    import threading

    conn = S._connector(sc, "attention", 0)
    conn.start()
    lost = threading.Event()
    conn.watch_peers(lambda why: lost.set())
    x, outs = _step_tensors(sc)
    graph = _capture(conn, x, outs)
    for step in (2, 3):
        _replay_exact(conn, graph, step, x, outs)
    conn.send_plan(StepPlan(4, ExecMode.REPLAY, (x.shape[0],)))
    t0 = time.monotonic()
    graph.replay()  # the FFN dies on this plan: the waits end at the abort
    torch.cuda.synchronize()
    ended = time.monotonic() - t0
    if not lost.wait(30):
        raise AssertionError("the FFN process died unnoticed")
    try:
        conn.check()
    except AFDError as e:
        error = f"{type(e).__name__}: {e}"
    else:
        raise AssertionError("a replay whose FFN died passed its check")
    conn.close("rejoin: test")
    conn = S._connector(sc, "attention", 0)
    conn.start()  # the second FFN process
    conn.resume()
    for step in range(5, 5 + STEPS):
        _replay_exact(conn, graph, step, x, outs)
    conn.close()
    return {"ok": True, "error": error, "ended_s": ended, "replays": STEPS}


def _serve_step(conn: Any) -> None:
    """Serve one planned step's LAYERS exchanges eagerly."""
    for layer in range(LAYERS):
        batch = conn.recv_a2f(layer, 0)
        conn.send_f2a(layer, 0, S.ffn_fn(batch.hidden, None, layer))
    conn.flush()


def _dying_ffn(sc: S.Scenario) -> None:
    conn = S._connector(sc, "ffn", 0)
    conn.start()
    conn.recv_plan()  # warm-up: the attention exchanges eagerly
    _serve_step(conn)
    conn.recv_plan()  # capture: recorded there, nothing is exchanged
    for _ in range(2):  # two replays served, eagerly here
        conn.recv_plan()
        _serve_step(conn)
    conn.recv_plan()
    conn.recv_a2f(0, 0)
    torch.cuda.synchronize()
    import os

    os._exit(0)  # mid-step, no SHUTDOWN


def rejoin_ffn(sc: S.Scenario) -> dict[str, Any]:
    """A first FFN process that dies mid-step, then this one, eager (its
    graph cache is empty: a REPLAY plan misses and is served eagerly)."""
    ctx = S._context()
    first = ctx.Process(target=_dying_ffn, args=(sc,))
    first.start()
    first.join(120)
    if first.exitcode != 0:
        return {"ok": False, "message": f"first ffn exited {first.exitcode}"}
    conn = S._connector(sc, "ffn", 0)
    conn.start()
    served = 0
    while conn.recv_plan() is not None:
        _serve_step(conn)
        served += 1
    conn.close()
    return {"ok": True, "served": served}


PROGRAMS = {
    "rejoin": (rejoin_attention, rejoin_ffn),
    "graph": (graph_attention, graph_ffn),
    "desync": (desync_attention, desync_ffn),
    "timeout": (timeout_attention, silent_ffn),
}
#: programs of several attention ranks: called with (scenario, rank)
RANKED = {"many": (many_attention, many_ffn)}


def main(name: str, role: str, rank: int, sc: S.Scenario, q: Any) -> None:
    # a program still running long past its timeout prints where it is
    faulthandler.dump_traceback_later(sc.timeout_s + 30, repeat=True, file=sys.stderr)
    try:
        if name in RANKED:
            att, ffn = RANKED[name]
            out = (att if role == "attention" else ffn)(sc, rank)
        else:
            att, ffn = PROGRAMS[name]
            out = (att if role == "attention" else ffn)(sc)
    except BaseException:
        out = {"ok": False, "message": traceback.format_exc()}
    q.put(((role, rank), out))
