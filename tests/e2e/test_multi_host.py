"""Roles on several hosts, each host a network namespace of its own (own
network stack, one address on a shared bridge), started by the same
``vllm-afd launch`` command on every host with that host's ``--node-rank``:
2A2F on three hosts, attention rank 0 on host 0 (API), rank 1 on host 1
(vLLM headless data parallelism), FFN rank 0 on host 2, FFN rank 1 on host 1.
The output is compared token for token with plain vLLM (one server,
loopback) on the same model and settings. Then FFN rank 1, beside the
headless attention rank, is SIGKILLed: its host's launcher restarts it, the
API host's ``/health`` answers 503 (its own rank's FFN rank re-forms the
deployment) until every rank has rejoined, the attention server and FFN rank
0 keep running (same processes), and the output is exact again. Last, the
API host's launcher is stopped (SIGTERM): every other host's launcher stops
its roles by itself and exits 0, restarting nothing.

This is also the CI test of one FFN rank of 2A2F dying (the M:N fault):
every attention rank pauses, not only the dead rank's peer. Every link of
1A1F and 2A1F across hosts is one of these links (an FFN rank's attention
peers on other hosts, a headless attention rank), so they are not run on
their own. Needs root and ``ip``; the namespaces go with the test, on every
exit path.
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
    wait_for,
)
from hosts import emulated_hosts, unavailable

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.usefixtures("quiet_host"),
    pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
]

READY_TIMEOUT_S = 600.0
#: the settings and prompts of test_families.py's Qwen3-MoE, on its model:
#: the session runs plain vLLM for them once (harness.plain_outputs)
EXTRA = ["--dtype", "float32", "--enforce-eager"]
TEXTS = prompts(16)
#: fp32 logprobs: DP ranks batch differently from one plain server
ATOL = 1e-4
#: the line each node's launcher prints once its processes are healthy
READY = r"^AFD \d+A\d+F ready"

CASES = {
    # name: (A, F, attention nodes, ffn nodes, hosts, node of an FFN to kill)
    "2A2F-3hosts": (2, 2, "0,1", "2,1", 3, 1),
}
#: an FFN restart (after the launcher's 1 s backoff) and the re-form
RECOVER_S = 300.0
#: the other nodes stop by themselves this long after the API node's launcher
STOP_S = 120.0


@pytest.fixture(scope="module")
def model(family_models):
    return family_models["qwen3_moe"]


@pytest.fixture(scope="module")
def plain(model):
    return plain_outputs(make_spec(model, EXTRA), TEXTS)


def _launch_argv(model, a: int, f: int, att: str, ffn: str, addrs: list[str]):
    return [
        sys.executable, "-m", "vllm_afd.cli.main", "launch", str(model),
        "-A", str(a), "-F", str(f), "--hosts", ",".join(addrs),
        "--attention-nodes", att, "--ffn-nodes", ffn, "--verbose",
        # FFN rank 1 stops timeout_s after FFN rank 0 when its peer idles
        "--connector-extra-config", '{"timeout_s": 10}',
        "--", *BASE_ARGS, *EXTRA,
    ]  # fmt: skip


def _server_pid(launcher_pid: int, role: str = "ffn") -> int:
    """The ``role`` server that the launcher with pid ``launcher_pid``
    started: the outermost process under it with that role's argv
    (namespaces share this pid space)."""
    level = [launcher_pid]
    while level:
        for pid in level:
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if f'"role": "{role}"'.encode() in argv:
                return pid
        level = [c for pid in level for c in children(pid)]
    raise AssertionError(f"launcher {launcher_pid} runs no {role} server")


def _survivors(nodes: list[Collected]) -> tuple[int, int]:
    """The attention server (node 0) and FFN rank 0 (node 2): they outlive
    the fault."""
    return _server_pid(nodes[0].proc.pid, "attention"), _server_pid(nodes[2].proc.pid)


def _kill_ffn_and_rejoin(
    nodes: list[Collected], kill_on: int, url: str, texts, plain
) -> dict:
    """SIGKILL the FFN server of node ``kill_on``: its launcher restarts it,
    the API host's /health answers 503 until the deployment has re-formed,
    the attention server (node 0) and the other FFN rank (node 2) keep
    running, and the output is exact again. Seconds of each part."""
    node = nodes[kill_on]
    pid = _server_pid(node.proc.pid)
    stay = _survivors(nodes)
    killed = time.monotonic()
    os.killpg(pid, signal.SIGKILL)
    down = wait_for(lambda: health_down(url, "ffn rank"), 30, "/health 503")
    node.wait_line(r"restarting it in", 30)
    node.wait_line(r"starting ffn\d? again", 60)
    wait_for(lambda: http_get(f"{url}/health")[0] == 200, RECOVER_S, "/health 200")
    back = time.monotonic() - killed
    assert_same_outputs(run_workload(url, served_model(url), texts), plain, atol=ATOL)
    assert _survivors(nodes) == stay, "the attention server or FFN rank 0 was restarted"
    assert any("re-forms the deployment" in x for n in nodes for x in n.lines)
    return {"/health 503": down, "serving again": back}


def _stop_from_the_api_node(nodes: list[Collected]) -> float:
    """Stop the API node's launcher (SIGTERM): it exits 0, and every other
    node's launcher stops its node by itself and exits 0, saying why; no
    FFN rank is restarted (an FFN rank is often inside a step then, and a
    headless attention rank often exits before its node's FFN rank says the
    deployment was stopped). Seconds from the API node's exit to the last."""

    def restarts() -> int:
        return sum("again (restart" in x for n in nodes for x in n.lines)

    before = restarts()
    nodes[0].stop()
    assert nodes[0].proc.returncode == 0, "".join(nodes[0].lines[-40:])
    stopped = time.monotonic()
    for i, node in enumerate(nodes[1:], 1):
        wait_for(
            lambda n=node: n.proc.poll() is not None,
            STOP_S,
            f"node {i}'s launcher to stop by itself",
        )
        tail = "".join(node.lines[-40:])
        assert node.proc.returncode == 0, tail
        assert any("stopped by itself" in x for x in node.lines), tail
    assert restarts() == before, "an FFN rank was restarted after the stop"
    return time.monotonic() - stopped


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
                fault = _kill_ffn_and_rejoin(nodes, kill_on, url, TEXTS, plain)
            fault["other nodes stopped"] = _stop_from_the_api_node(nodes)
        except BaseException:
            for i, node in enumerate(nodes):  # without the /health polls
                kept = [x for x in node.lines if '"GET /health HTTP' not in x]
                print(f"--- node {i}:\n" + "".join(kept[-150:]))
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
