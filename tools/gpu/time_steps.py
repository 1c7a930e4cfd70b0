"""Wall time per decode step of a running server, batch by batch.

For each concurrency C in turn, C greedy requests of ``--output-len`` new
tokens (``ignore_eos``) start together; the batch's wall time divided by
``--output-len`` is its time per step (its prefill included). A request that
fails is counted, and the next batch waits for ``/health`` again. Prints one
line per batch and writes them to ``--json``.

    python tools/gpu/time_steps.py http://localhost:8000 --label afd \
        --concurrency 8,32,1,1,1,8,8,8,32,32,32 --json afd.json

List each concurrency once untimed first (its first batch compiles
kernels) and read the medians of the repeats.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from vllm_afd.cli.client import post_json, served_model


def _one(url: str, model: str, i: int, tokens: int) -> bool:
    body = {
        "model": model, "prompt": f"hello number {i} " * 4, "max_tokens": tokens,
        "temperature": 0.0, "ignore_eos": True,
    }  # fmt: skip
    try:
        post_json(f"{url}/v1/completions", body, timeout=120)
    except (urllib.error.URLError, OSError):
        return False
    return True


def _wait_healthy(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(1)
    raise SystemExit(f"{url}/health did not answer 200 within {timeout:.0f}s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("--label", default="server")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--json")
    args = p.parse_args()
    model = served_model(args.url)
    rows = []
    for conc in (int(c) for c in args.concurrency.split(",")):
        t0 = time.monotonic()
        with ThreadPoolExecutor(conc) as pool:
            ok = list(
                pool.map(
                    lambda i: _one(args.url, model, i, args.output_len), range(conc)
                )
            )
        ms = (time.monotonic() - t0) / args.output_len * 1000
        rows.append({"concurrency": conc, "ms_per_step": ms, "failed": ok.count(False)})
        print(f"{args.label} concurrency {conc}: {ms:.2f} ms/step, "
              f"{ok.count(False)} failed", flush=True)  # fmt: skip
        if not all(ok):
            _wait_healthy(args.url, 120)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"label": args.label, "batches": rows}, f, indent=2)


if __name__ == "__main__":
    main()
