"""Split the GPU suite into shards that each fit one time-limited run.

    python3 tools/gpu/shard.py I/N [-k EXPR]

prints the pytest node ids of shard I (1-based) of N, one per line: the
tests ``pytest -m gpu tests/gpu tests/connector`` collects (``-k`` as
pytest's), spread so that the shards' estimated seconds are as even as a
greedy split makes them (longest first, each to the least loaded shard).
The estimates (:data:`SECONDS`) are rough: a test that starts servers
costs its role processes' and plain vLLM's start-up, the others a few
seconds, and a test needing more GPUs than this host has (``gpus(n)``, 2 in
tests/gpu without it) skips in no time. ``tools/gpu/run_gpu_tests.sh
--shard I/N`` runs one shard.
"""

from __future__ import annotations

import contextlib
import io
import sys

#: estimated seconds per test, by the longest matching node-id prefix
SECONDS = {
    "tests/connector/": 10.0,
    # 1000 graph replays per attention rank (about 6 s each on one H100)
    "tests/connector/test_cuda_ipc.py::test_cuda_ipc_attention_ranks_sharing": 15.0,
    "tests/gpu/test_cuda_workers.py": 5.0,
    "tests/gpu/test_compute_clock_gpu.py": 10.0,
    "tests/gpu/test_async_gpu.py::test_async_refuses": 5.0,
    "tests/gpu/test_overlap_report_gpu.py": 60.0,
    "tests/gpu/": 100.0,
}


#: what a test that skips for want of GPUs costs
SKIPPED_S = 0.1


def estimate(node_id: str) -> float:
    """Seconds :data:`SECONDS` gives ``node_id`` (its longest prefix)."""
    prefix = max((p for p in SECONDS if node_id.startswith(p)), key=len, default="")
    return SECONDS.get(prefix, 100.0)


def split(
    node_ids: list[str], shards: int, seconds: dict[str, float] | None = None
) -> list[list[str]]:
    """``node_ids`` in ``shards`` lists of near-equal estimated time
    (``seconds``, else :func:`estimate`), each in collection order (module
    fixtures stay shared within a shard)."""
    if shards < 1:
        raise ValueError(f"shards={shards} must be at least 1")
    cost = seconds or {n: estimate(n) for n in node_ids}
    load = [0.0] * shards
    where: dict[str, int] = {}
    for node in sorted(node_ids, key=lambda n: cost[n], reverse=True):
        i = min(range(shards), key=lambda k: (load[k], k))
        where[node] = i
        load[i] += cost[node]
    return [[n for n in node_ids if where[n] == i] for i in range(shards)]


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` as (I, N), 1 <= I <= N; ValueError naming what is wrong."""
    i, sep, n = text.partition("/")
    if not (sep and i.isdigit() and n.isdigit()) or not 1 <= int(i) <= int(n):
        raise ValueError(f"--shard {text!r}: expected I/N with 1 <= I <= N")
    return int(i), int(n)


def gpus_needed(node_id: str, marker_gpus: int | None) -> int:
    """GPUs a test needs: its ``gpus(n)`` marker, else 2 in tests/gpu
    (tests/gpu/conftest.py) and 1 elsewhere."""
    if marker_gpus is not None:
        return marker_gpus
    return 2 if node_id.startswith("tests/gpu/") else 1


def collect(select: list[str]) -> dict[str, float]:
    """The GPU suite's node ids as pytest collects them, with their
    estimated seconds on this host."""
    import pytest
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    found: dict[str, float] = {}

    class Recorder:
        # after collection is finished: ``-m gpu`` and ``-k`` have deselected
        def pytest_collection_finish(self, session: pytest.Session) -> None:
            for item in session.items:
                marker = item.get_closest_marker("gpus")
                n = gpus_needed(item.nodeid, marker.args[0] if marker else None)
                found[item.nodeid] = estimate(item.nodeid) if n <= have else SKIPPED_S

    argv = ["--collect-only", "-qq", "-p", "no:cacheprovider", "-m", "gpu",
            "tests/gpu", "tests/connector", *select]  # fmt: skip
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        code = pytest.main(argv, plugins=[Recorder()])
    if code not in (0, 5) or not found:
        raise SystemExit(f"collecting the GPU tests failed ({code}):\n{log.getvalue()}")
    return found


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        i, n = parse_shard(argv[0])
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    seconds = collect(argv[1:])
    print("\n".join(split(list(seconds), n, seconds)[i - 1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
