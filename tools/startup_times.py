"""Seconds from ``vllm-afd launch`` to its ready line, on this host.

    python tools/startup_times.py MODEL --topologies 1A1F,2A1F,2A2F --runs 3 \
        -- --enforce-eager --dtype float32 --max-model-len 512

Prints one line per topology: the median and every run. The e2e run across
emulated hosts (tests/e2e/test_multi_host.py) prints the same figure per
layout in its summary, so the two compare like for like on one machine.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time

READY = re.compile(r"^AFD \d+A\d+F ready")


def time_to_ready(
    model: str, a: int, f: int, vllm_args: list[str], limit: float
) -> float:
    argv = [
        sys.executable, "-m", "vllm_afd.cli.main", "launch", model,
        "-A", str(a), "-F", str(f), "--", *vllm_args,
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if READY.search(line):
                return time.monotonic() - t0
            if time.monotonic() - t0 > limit:
                break
        raise RuntimeError(f"{a}A{f}F: no ready line within {limit:.0f}s")
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> int:
    argv = sys.argv[1:]
    vllm_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, vllm_args = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--topologies", default="1A1F,2A1F,2A2F")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--limit", type=float, default=600.0, help="seconds per run")
    args = p.parse_args(argv)
    for name in args.topologies.split(","):
        a, f = (int(x) for x in re.fullmatch(r"(\d+)A(\d+)F", name).groups())
        runs = [
            time_to_ready(args.model, a, f, vllm_args, args.limit)
            for _ in range(args.runs)
        ]
        shown = ", ".join(f"{r:.0f}" for r in runs)
        print(f"{name}: ready after {statistics.median(runs):.0f}s median ({shown})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
