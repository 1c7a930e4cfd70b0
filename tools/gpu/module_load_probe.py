"""Does a CUDA operation in one process wait for a kernel of another process
that spins on a flag, as the ``cuda_ipc`` planes' device waits do?

Process A launches a kernel that spins until a flag in its GPU memory is
set, or ``--spin-s`` passed (the device clock). Process B, which maps the
flag through CUDA IPC, runs one operation and then sets the flag. An
operation that takes about ``--spin-s`` and a spin that ran out mean B's
operation waited for A's kernel: with waits that spin until the other
process answers, that is a deadlock which only the connector's
``timeout_s`` ends. Operations (each first met in B at that moment):

  noop         nothing (the control)
  sync         ``torch.cuda.synchronize()`` (B's own work is done by then)
  lazy_torch   a PyTorch kernel B never launched (CUDA lazy module loading)
  triton_new   a Triton kernel compiled and loaded for the first time
  empty_cache  freeing cached memory (cudaFree)
  malloc       a new 1 GiB allocation (cudaMalloc)
  graph        capturing and replaying a CUDA graph (``torch.cuda.graph``,
               which synchronises and empties the cache on entry)
  graph_plain  the same capture without those two calls, as the FFN
               role captures (``worker.ffn_graphs``)
  cublas_new   the first matmul of another dtype

With ``--own`` process B also spins on a flag of its own, on a side
stream, during the operation, and sets it only afterwards: an operation
that takes ``--spin-s`` then waited for a kernel of its own process (what
NVIDIA's lazy-loading guide warns a module load may do).

Both processes must run their kernels at once: on one GPU start the MPS
daemon first (``nvidia-cuda-mps-control -d``). Compare with
``CUDA_MODULE_LOADING=EAGER`` in the environment.

    python tools/gpu/module_load_probe.py --json probe.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from typing import Any

import torch
import triton
import triton.language as tl

OPS = ("noop", "sync", "lazy_torch", "triton_new", "empty_cache", "malloc", "graph",
       "graph_plain", "cublas_new")  # fmt: skip
_LAZY = ("i0e", "erfcx", "bessel_j1", "ndtri", "log_ndtr", "i1e", "bessel_y0")


@triton.jit
def _now():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _spin(flag_ptr, out_ptr, timeout_ns):
    start = _now()
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    spent = _now() - start
    while (seen == 0) & (spent < timeout_ns):
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        spent = _now() - start
    tl.store(out_ptr, spent)
    tl.store(out_ptr + 1, seen)


def _run(op: str, trial: int) -> None:
    """Operation ``op``, new to this process at every ``trial``."""
    if op == "lazy_torch":
        getattr(torch.special, _LAZY[trial % len(_LAZY)])(torch.rand(64, device="cuda"))
    elif op == "triton_new":

        @triton.jit
        def fill(p, value: tl.constexpr):
            tl.store(p + tl.arange(0, 16), tl.arange(0, 16) * value)

        fill[(1,)](torch.empty(16, device="cuda", dtype=torch.int32), 1000 + trial)
    elif op == "empty_cache":
        block = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        del block
        torch.cuda.empty_cache()
    elif op == "malloc":
        _run.kept = torch.empty((1 << 30) + trial, dtype=torch.uint8, device="cuda")  # type: ignore[attr-defined]
    elif op == "graph":
        x, graph = torch.ones(64, device="cuda"), torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
            x.mul_(3)
        graph.replay()
    elif op == "graph_plain":
        x, graph = torch.ones(64, device="cuda"), torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graph.capture_begin()
            x.mul_(3)
            graph.capture_end()
        graph.replay()
    elif op == "cublas_new":
        dtype = (torch.float32, torch.float16, torch.float64)[trial % 3]
        a = torch.rand(256, 256, device="cuda", dtype=dtype)
        a @ a
    elif op == "sync":
        torch.cuda.synchronize()


def _peer(todo: Any, done: Any, pause_s: float, own_ns: int) -> None:
    """Process B: for each (op, trial), run it and then set the flag; with
    ``own_ns``, while a kernel of B's own spins on a side stream."""
    flag = todo.get()
    flag.fill_(0)
    own_flag = torch.ones(1, dtype=torch.int64, device="cuda")
    own_out = torch.zeros(2, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    if own_ns:
        _spin[(1,)](own_flag, own_out, own_ns)  # compiled before any trial
    torch.cuda.synchronize()
    done.put("ready")
    while (item := todo.get()) is not None:
        if own_ns:
            own_flag.zero_()
            torch.cuda.synchronize()
            with torch.cuda.stream(side):
                _spin[(1,)](own_flag, own_out, own_ns)
        time.sleep(pause_s)  # the spinning kernels run by now
        start, error = time.perf_counter(), ""
        try:
            _run(*item)
        except Exception as exc:  # reported, the flags still set
            error = f"{type(exc).__name__}: {exc}"[:200]
        took = time.perf_counter() - start  # the host's time in the operation
        own_flag.fill_(1)
        flag.fill_(1)
        torch.cuda.synchronize()
        own = own_out[0].item() / 1e9 if own_ns else 0.0
        done.put((took, error, own))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--ops", default=",".join(OPS), help="comma-separated, of: " + ", ".join(OPS)
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--spin-s", type=float, default=5.0, help="A's spin limit (device clock)"
    )
    p.add_argument(
        "--own", action="store_true",
        help="B also spins on a flag of its own (a side stream) during the "
        "operation: does the operation wait for its own process's kernel?",
    )  # fmt: skip
    p.add_argument("--json", default=None, help="write the rows here too")
    args = p.parse_args()
    ops = args.ops.split(",")
    if unknown := sorted(set(ops) - set(OPS)):
        p.error(f"--ops: unknown {', '.join(unknown)}; valid: {', '.join(OPS)}")
    ctx = mp.get_context("spawn")
    todo, done = ctx.Queue(), ctx.Queue()
    timeout_ns = int(args.spin_s * 1e9)
    own_ns = timeout_ns if args.own else 0
    peer = ctx.Process(target=_peer, args=(todo, done, 0.3, own_ns), daemon=True)
    peer.start()
    flag = torch.ones(1, dtype=torch.int64, device="cuda")
    out = torch.zeros(2, dtype=torch.int64, device="cuda")
    _spin[(1,)](flag, out, timeout_ns)  # compiled and loaded before any trial
    torch.cuda.synchronize()
    todo.put(flag)
    if done.get(timeout=120) != "ready":
        raise SystemExit("the peer process did not start")
    rows = []
    head = ("operation in B", "B s", "A spun s", "B spun s")
    print(f"{head[0]:<14} {head[1]:>7} {head[2]:>9} {head[3]:>9}  A's spin")
    for trial in range(args.repeats):
        for op in ops:
            flag.zero_()
            torch.cuda.synchronize()
            _spin[(1,)](flag, out, timeout_ns)
            todo.put((op, trial))
            took, error, own = done.get(timeout=args.spin_s + 120)
            torch.cuda.synchronize()
            spun, seen = out[0].item() / 1e9, out[1].item()
            row = dict(op=op, trial=trial, b_s=round(took, 3), error=error,
                       a_spun_s=round(spun, 3), a_ran_out=seen == 0,
                       b_spun_s=round(own, 3))  # fmt: skip
            rows.append(row)
            verdict = "RAN OUT: B waited for it" if seen == 0 else "ended by B"
            if args.own and took >= 0.9 * args.spin_s:
                verdict += "; B waited for its own kernel"
            print(f"{op:<14} {took:7.3f} {spun:9.3f} {own:9.3f}  {verdict} {error}",
                  flush=True)  # fmt: skip
    todo.put(None)
    peer.join(30)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"spin_s": args.spin_s, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
