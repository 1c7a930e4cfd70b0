"""The FFN dies while the attention role decodes from CUDA graphs: no hang.

A FULL graph replay waits for the FFN's transfers on the GPU, where no host
timeout reaches. The attention role's peer watch sees the FFN's control
connection drop and stops the engine at once: the in-flight stream fails
within seconds, new requests fail, and the attention log names the FFN peer.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.error

import pytest
from gpu_harness import on_devices
from harness import Deployment, LogSink, complete, make_spec, served_model

pytestmark = pytest.mark.gpu

GRAPHS = [
    "--dtype",
    "bfloat16",
    "--gpu-memory-utilization",
    "0.2",
    "--compilation-config",
    '{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}',
    "--max-model-len",
    "4096",
]
LONG = 3500  # new tokens: seconds of graph decode, far past the kill


def _long_request(url: str, model: str, outcome: dict) -> None:
    try:
        out = complete(url, model, "experts " * 50, LONG, stream=True, timeout=120)
        n = len(out.token_ids)
        outcome["result"] = "completed" if n == LONG else f"failed: {n} tokens"
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        outcome["result"] = f"failed: {exc!r}"


def test_ffn_killed_during_graph_decode_fails_requests_at_once(gpu_tiny_models):
    log = LogSink()
    afd = Deployment(make_spec(gpu_tiny_models["deepseek_v2"], GRAPHS), log=log)
    on_devices(afd.attention, "0")
    on_devices(afd.ffn, "1")
    try:
        afd.start(ready_timeout=600)
        model = served_model(afd.api_url)
        complete(afd.api_url, model, "warm up", 4, stream=False)
        outcome: dict = {}
        worker = threading.Thread(
            target=_long_request, args=(afd.api_url, model, outcome)
        )
        worker.start()
        time.sleep(1.5)
        killed_at = time.monotonic()
        os.killpg(afd.ffn.proc.pid, signal.SIGKILL)
        worker.join(60)
        assert not worker.is_alive(), "in-flight request hung after the FFN died"
        assert outcome["result"].startswith("failed"), outcome
        print(f"stream failed {time.monotonic() - killed_at:.1f} s after the kill")
        with pytest.raises((urllib.error.URLError, OSError)):
            complete(afd.api_url, model, "after", 4, stream=False, timeout=60)
    finally:
        afd.stop()
    text = log.getvalue()
    assert "ffn rank 0 closed its connection" in text, text[-3000:]
