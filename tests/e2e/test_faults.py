"""Faults between real role processes: nothing hangs, errors name the peer.

* The FFN dies mid-decode: in-flight and new requests on the attention role
  fail within the connector timeout, and the attention log names the FFN peer.
* The attention role stops: the FFN role exits by itself, cleanly.
"""

from __future__ import annotations

import time

import pytest
from harness import (
    assert_ffn_kill_fails_requests,
    complete,
    make_spec,
    served_model,
    start,
)

pytestmark = pytest.mark.e2e

TIMEOUT_S = 10.0
LONG = 450  # new tokens: far more than decode in the 2 s before the kill


def _start(tiny_models):
    spec = make_spec(
        tiny_models["deepseek_v2"],
        ["--dtype", "float32", "--enforce-eager"],
        connector_extra_config={"timeout_s": TIMEOUT_S},
    )
    return start(spec)


def test_ffn_killed_mid_decode_fails_requests_within_timeout(tiny_models):
    afd, log = _start(tiny_models)
    try:
        assert_ffn_kill_fails_requests(afd, LONG, after_s=2.0, join_s=TIMEOUT_S + 60)
    finally:
        afd.stop()
    text = log.getvalue()
    assert "ffn rank 0" in text, text[-3000:]


def test_attention_stop_makes_ffn_exit_cleanly(tiny_models):
    afd, _ = _start(tiny_models)
    try:
        model = served_model(afd.api_url)
        complete(afd.api_url, model, "hello", 4, stream=False)
        afd.attention.stop(timeout=60)
        deadline = time.monotonic() + 60
        while afd.ffn.exit_code() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert afd.ffn.exit_code() == 0
    finally:
        afd.stop()
