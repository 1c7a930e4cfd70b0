"""p2p-only behaviour: ports in use, unreachable rendezvous."""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _scenarios as S  # noqa: E402

from vllm_afd.errors import AFDConnectorError, AFDTimeoutError  # noqa: E402


def test_port_in_use_names_address_and_fix():
    port = S.free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        ffn = S._connector(S.Scenario("p2p", port, 1, 1), "ffn", 0)
        with pytest.raises(AFDConnectorError) as e:
            ffn.start()
    msg = str(e.value)
    assert f"127.0.0.1:{port}" in msg and "already in use" in msg
    assert "afd.port" in msg


def test_unreachable_ffn_fails_after_connect_timeout():
    sc = S.Scenario("p2p", S.free_port(), 1, 1, connect_timeout_s=0.5)
    att = S._connector(sc, "attention", 0)
    t0 = time.monotonic()
    with pytest.raises(AFDTimeoutError, match=f"could not reach 127.0.0.1:{sc.port}"):
        att.start()
    assert time.monotonic() - t0 < 3
