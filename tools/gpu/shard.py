"""Split the GPU suite into shards that each fit one time-limited run.

    python3 tools/gpu/shard.py I/N [-k EXPR]

prints the pytest node ids of shard I (1-based) of N, one per line: the
tests ``pytest -m gpu tests/gpu tests/connector`` collects (``-k`` as
pytest's), spread so that the shards' estimated seconds are as even as a
greedy split makes them (longest first, each to the least loaded shard).
The estimates (:data:`SECONDS`) are from one H200: a test that starts
servers costs its role processes' and plain vLLM's start-up, the others a
few seconds. ``tools/gpu/run_gpu_tests.sh --shard I/N`` runs one shard.
"""

from __future__ import annotations

import subprocess
import sys

#: estimated seconds per test, by the longest matching node-id prefix
SECONDS = {
    "tests/connector/": 10.0,
    "tests/gpu/test_cuda_workers.py": 5.0,
    "tests/gpu/test_async_gpu.py::test_async_refuses": 5.0,
    "tests/gpu/test_overlap_report_gpu.py": 60.0,
    "tests/gpu/": 100.0,
}


def estimate(node_id: str) -> float:
    """Seconds :data:`SECONDS` gives ``node_id`` (its longest prefix)."""
    prefix = max((p for p in SECONDS if node_id.startswith(p)), key=len, default="")
    return SECONDS.get(prefix, 100.0)


def split(node_ids: list[str], shards: int) -> list[list[str]]:
    """``node_ids`` in ``shards`` lists of near-equal estimated time, each in
    collection order (module fixtures stay shared within a shard)."""
    if shards < 1:
        raise ValueError(f"shards={shards} must be at least 1")
    load = [0.0] * shards
    where: dict[str, int] = {}
    for node in sorted(node_ids, key=estimate, reverse=True):
        i = min(range(shards), key=lambda k: (load[k], k))
        where[node] = i
        load[i] += estimate(node)
    return [[n for n in node_ids if where[n] == i] for i in range(shards)]


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` as (I, N), 1 <= I <= N; ValueError naming what is wrong."""
    i, sep, n = text.partition("/")
    if not (sep and i.isdigit() and n.isdigit()) or not 1 <= int(i) <= int(n):
        raise ValueError(f"--shard {text!r}: expected I/N with 1 <= I <= N")
    return int(i), int(n)


def collect(select: list[str]) -> list[str]:
    """The node ids pytest collects for the GPU suite."""
    argv = [sys.executable, "-m", "pytest", "--collect-only", "-q",
            "-p", "no:cacheprovider", "-m", "gpu", "tests/gpu", "tests/connector",
            *select]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, check=False)
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    if out.returncode not in (0, 5) or not ids:
        raise SystemExit(f"collecting the GPU tests failed:\n{out.stdout}{out.stderr}")
    return ids


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        i, n = parse_shard(argv[0])
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    print("\n".join(split(collect(argv[1:]), n)[i - 1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
