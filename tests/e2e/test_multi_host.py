"""Roles on several hosts, each host a network namespace of its own (own
network stack, one address on a shared bridge), started by the same
``vllm-afd launch`` command on every host with that host's ``--node-rank``:

* 2A1F: attention rank 0 on host 0 (API), rank 1 on host 1 (vLLM headless
  data parallelism), the FFN on host 2;
* 2A2F: attention as in 2A1F, FFN rank 0 on host 2, FFN rank 1 on host 1.
  Then FFN rank 1, beside the headless attention rank, is SIGKILLed: its
  host's launcher restarts it, the API host's ``/health`` answers 503 (its
  own rank's FFN rank re-forms the deployment) until every rank has
  rejoined, and the output is exact again.

(1A1F across two hosts is the 2A1F case's link from host 0 to host 2, so it is
not run on its own.) Each is compared token for token with plain vLLM (one
server, loopback) on the same model and settings. Needs root and ``ip``; the
namespaces go with the test, on every exit path.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from harness import (
    BASE_ARGS,
    HOST_RESULTS,
    Collected,
    assert_same_outputs,
    children,
    health_down,
    http_get,
    make_spec,
    plain_outputs,
    prompts,
    run_workload,
    served_model,
    wait_every_api_server,
    wait_for,
)
from hosts import emulated_hosts, unavailable

from vllm_afd.models.tiny_checkpoint import write_tiny_checkpoint

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
]

READY_TIMEOUT_S = 600.0
EXTRA = ["--enforce-eager", "--dtype", "float32"]
TEXTS = prompts(8)
#: fp32 logprobs: DP ranks batch differently from one plain server
ATOL = 1e-4
#: the line each node's launcher prints once its processes are healthy
READY = r"^AFD \d+A\d+F ready"

CASES = {
    # name: (A, F, attention nodes, ffn nodes, hosts, node of an FFN to kill)
    "2A1F-3hosts": (2, 1, "0,1", "2", 3, None),
    "2A2F-3hosts": (2, 2, "0,1", "2,1", 3, 1),
}
#: an FFN restart (after the launcher's 1 s backoff) and the re-form
RECOVER_S = 300.0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    return write_tiny_checkpoint(root / "qwen3", arch="qwen3_moe", num_layers=2)


@pytest.fixture(scope="module")
def plain(model):
    return plain_outputs(make_spec(model, EXTRA), TEXTS)


def _launch_argv(model, a: int, f: int, att: str, ffn: str, addrs: list[str]):
    return [
        sys.executable, "-m", "vllm_afd.cli.main", "launch", str(model),
        "-A", str(a), "-F", str(f), "--hosts", ",".join(addrs),
        "--attention-nodes", att, "--ffn-nodes", ffn,
        "--", *BASE_ARGS, *EXTRA,
    ]  # fmt: skip


def _ffn_server_pid(launcher_pid: int) -> int:
    """The FFN server that the launcher with pid ``launcher_pid`` started:
    the outermost process under it with an FFN role's argv (namespaces
    share this pid space)."""
    level = [launcher_pid]
    while level:
        for pid in level:
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b'"role": "ffn"' in argv:
                return pid
        level = [c for pid in level for c in children(pid)]
    raise AssertionError(f"launcher {launcher_pid} runs no FFN server")


def _kill_ffn_and_rejoin(node: Collected, url: str, texts, plain) -> dict:
    """SIGKILL the FFN server of ``node``: its launcher restarts it, the API
    host's /health answers 503 until the deployment has re-formed, and the
    output is exact again. Seconds of each part."""
    pid = _ffn_server_pid(node.proc.pid)
    killed = time.monotonic()
    os.killpg(pid, signal.SIGKILL)
    down = wait_for(lambda: health_down(url, "ffn rank"), 30, "/health 503")
    node.wait_line(r"restarting it in", 30)
    node.wait_line(r"starting ffn\d? again", 60)
    wait_every_api_server(
        lambda: http_get(f"{url}/health")[0] == 200, RECOVER_S, "/health 200"
    )
    back = time.monotonic() - killed
    assert_same_outputs(run_workload(url, served_model(url), texts), plain, atol=ATOL)
    return {"/health 503": down, "serving again": back}


@pytest.mark.parametrize("case", list(CASES))
def test_roles_on_several_hosts_are_exact(model, plain, case):
    a, f, att, ffn, n, kill_on = CASES[case]
    fault: dict[str, float] = {}
    with emulated_hosts(n) as (hosts, _mine):
        addrs = [h.address for h in hosts]
        base = _launch_argv(model, a, f, att, ffn, addrs)
        t0 = time.monotonic()
        nodes = [
            Collected(h.argv([*base[:5], "--node-rank", str(i), *base[5:]]))
            for i, h in enumerate(hosts)
        ]
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            ready = [
                node.wait_line(READY, deadline - time.monotonic()) for node in nodes
            ][0]
            started = time.monotonic() - t0
            url = f"http://{addrs[0]}:8000"
            assert f"ready: {url}/v1 (node 0 of {n})" in ready, ready
            outputs = run_workload(url, served_model(url), TEXTS)
            if kill_on is not None:
                assert_same_outputs(outputs, plain, atol=ATOL)
                fault = _kill_ffn_and_rejoin(nodes[kill_on], url, TEXTS, plain)
        except BaseException:
            for i, node in enumerate(nodes):
                print(f"--- node {i}:\n" + "".join(node.lines[-80:]))
            raise
        finally:
            for node in nodes:  # the API node first: its stop tells the FFN
                node.stop()
    assert_same_outputs(outputs, plain, atol=ATOL)
    same = sum(o.token_ids == p.token_ids for o, p in zip(outputs, plain, strict=True))
    HOST_RESULTS.append(
        f"{case}: {same}/{len(plain)} identical, every node ready "
        f"{started:.0f}s after the launchers started"
        + (
            f"; FFN on node {kill_on} SIGKILLed: "
            + ", ".join(f"{k} {v:.1f}s" for k, v in fault.items())
            if fault
            else ""
        )
    )
