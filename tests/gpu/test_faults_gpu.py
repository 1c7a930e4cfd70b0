"""The FFN dies while the attention role decodes from CUDA graphs: no hang.

A FULL graph replay waits for the FFN's transfers on the GPU, where no host
timeout reaches. The attention role's peer watch sees the FFN's control
connection drop and stops the engine at once: the in-flight stream fails
within seconds, new requests fail, and the attention log names the FFN peer.
"""

from __future__ import annotations

import pytest
from gpu_harness import FULL_DECODE_ONLY, gpu_spec
from harness import (
    Deployment,
    LogSink,
    assert_ffn_kill_fails_requests,
)

pytestmark = pytest.mark.gpu

GRAPHS = [
    "--dtype",
    "bfloat16",
    "--gpu-memory-utilization",
    "0.2",
    *FULL_DECODE_ONLY,
    "--max-model-len",
    "2048",  # the tiny model's max_position_embeddings
]
LONG = 2000  # new tokens: seconds of graph decode, well past the kill


def test_ffn_killed_during_graph_decode_fails_requests_at_once(gpu_tiny_models):
    log = LogSink()
    afd = Deployment(gpu_spec(gpu_tiny_models["deepseek_v2"], GRAPHS), log=log)
    try:
        afd.start(ready_timeout=600)
        seconds = assert_ffn_kill_fails_requests(afd, LONG, after_s=0.5, join_s=60)
        print(f"stream failed {seconds:.1f} s after the kill")
    except BaseException:
        print(log.getvalue()[-20000:])
        raise
    finally:
        afd.stop()
    text = log.getvalue()
    assert "ffn rank 0 closed its connection" in text, text[-3000:]
