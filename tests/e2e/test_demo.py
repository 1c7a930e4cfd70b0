"""The README's main job: ``vllm-afd demo`` on a fresh tiny model.

It writes the model, serves it with AFD 1A1F and plain vLLM side by side,
answers completion, chat and streaming requests on both, and exits 0 only
when every answer is identical. Run as a user runs it: the console script, in its
own process group (the servers are its children), with a time limit.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from harness import free_port_pair, free_run

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.worker_processes,
    pytest.mark.usefixtures("quiet_host"),
]

DEMO_TIMEOUT_S = 900


def test_demo_answers_requests_as_plain_vllm_does(tmp_path: Path) -> None:
    afd_port = free_port_pair()
    # the API ports: attention, FFN (+1) and plain vLLM (+2)
    port = free_run(3, avoid={afd_port, afd_port + 1})
    model = tmp_path / "tiny"
    cmd = [
        str(Path(sys.executable).with_name("vllm-afd")),
        "demo",
        "--model-dir", str(model),
        "--port", str(port),
        "--afd-port", str(afd_port),
        "--max-tokens", "8",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=DEMO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(
            f"vllm-afd demo did not finish in {DEMO_TIMEOUT_S} s:\n{out[-4000:]}"
        ) from None
    assert proc.returncode == 0, f"vllm-afd demo exited {proc.returncode}:\n{out}"
    assert f"writing tiny deepseek_v2 model to {model}" in out
    assert f"AFD ready: http://127.0.0.1:{port}/v1" in out
    # plain vLLM was started beside the deployment, on the port after the FFN's
    assert f"plain vLLM ready: http://127.0.0.1:{port + 2}/v1" in out
    assert "identical: yes" in out
    assert "chat      -> " in out and "streaming -> " in out
    steps = re.search(r"^  steps +(\d+)$", out, re.MULTILINE)
    assert steps is not None and int(steps.group(1)) > 0, out
