"""``vllm-afd launch`` as an operator meets it, each case with its time bound:

* the ready line is the URL that answers; every socket the roles listen on
  is on loopback; no development-only warning at start; SIGTERM stops every
  process with exit 0, no traceback, no ERROR line, no leak report;
* SIGKILL of the launcher leaves no role process running, ports free;
* SIGTERM while the roles start stops them all within seconds;
* a server started by hand that is killed (SIGKILL) while its worker waits
  in the rendezvous takes its engine core and worker with it, within seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import (
    Collected,
    children,
    complete,
    free_port_pair,
    free_ports,
    live_pids,
    members,
    proc_stat,
    served_model,
)

from vllm_afd import lifeline
from vllm_afd.models.tiny_checkpoint import write_tiny_checkpoint

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.worker_processes,
    pytest.mark.alone,
    pytest.mark.usefixtures("quiet_host"),
]

READY_TIMEOUT_S = 420.0
#: every process of a role is gone this long after its launcher was killed
GONE_AFTER_KILL_S = 15.0
#: the launcher exits this long after SIGTERM while the roles start
STOPPED_AFTER_TERM_S = 20.0
LIFELINE_GRACE_S = lifeline.GRACE_S
VLLM_ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "512"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("launcher")
    return write_tiny_checkpoint(root / "qwen3", arch="qwen3_moe", num_layers=2)


# ------------------------------------------------------------- processes
def listening(pids: list[int]) -> list[tuple[str, int, int]]:
    """(address hex, port, pid) of every TCP socket ``pids`` listen on."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            address, port = cols[1].split(":")
            if cols[3] == "0A" and cols[9] in inodes:
                found.append((address, int(port, 16), inodes[cols[9]]))
    return found


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}


def _bindable(port: int) -> bool:
    """Whether a server could listen on ``port`` now (as servers do, with
    SO_REUSEADDR: connections in TIME_WAIT do not hold a port)."""
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


# -------------------------------------------------------------- launcher
class Launched(Collected):
    """``vllm-afd launch`` on free ports, its output collected."""

    def __init__(
        self, model: Path, *extra: str, env: dict[str, str] | None = None
    ) -> None:
        self.afd_port = free_port_pair()
        self.port, self.ffn_port = [
            p for p in free_ports(4) if p not in (self.afd_port, self.afd_port + 1)
        ][:2]
        super().__init__(
            [
                sys.executable,
                "-m",
                "vllm_afd.cli.main",
                "launch",
                str(model),
                "--port",
                str(self.port),
                "--ffn-port",
                str(self.ffn_port),
                "--afd-port",
                str(self.afd_port),
                *extra,
                "--",
                *VLLM_ARGS,
            ],  # fmt: skip
            env=env,
        )

    def role_groups(self) -> set[int]:
        """The role servers' process groups (each its own session)."""
        return {proc_stat(p)[2] for p in children(self.proc.pid) if proc_stat(p)}

    def cleanup(self) -> None:
        groups = self.role_groups()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pid in members(groups | {self.proc.pid}):
            os.kill(pid, signal.SIGKILL)


def _wait_gone(groups: set[int], timeout: float) -> float:
    t0 = time.monotonic()
    while members(groups) and time.monotonic() - t0 < timeout:
        time.sleep(0.1)
    left = members(groups)
    assert not left, f"still running {timeout}s later: {left}"
    return time.monotonic() - t0


# ----------------------------------------------------------------- cases
def _own_memory_sizing() -> dict[str, str]:
    """This environment without the suite's KV cache size: the launcher sizes
    the roles' memory itself, as for a user who set none."""
    return {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}


def test_ready_line_sockets_and_a_clean_stop(model, tmp_path):
    """Also: no memory setting anywhere (as a newcomer runs it): the launcher
    gives the attention role a KV cache that fits beside the FFN role, says
    so, and the default console shows no vLLM banner, each role's full log
    in --log-dir."""
    run = Launched(model, "--log-dir", str(tmp_path), env=_own_memory_sizing())
    try:
        ready = run.wait_line(r"ready: http", READY_TIMEOUT_S)
        url = f"http://127.0.0.1:{run.port}"
        assert ready.strip() == f"AFD 1A1F ready: {url}/v1"
        run.wait_line(r"memory: .* GiB of RAM available", 1)
        run.wait_line(rf"role logs in {tmp_path}", 1)
        attention_log = (tmp_path / "attention.log").read_text()
        assert "Explicitly set" in attention_log  # vLLM took the launcher's size
        assert "AFD connector up" in (tmp_path / "ffn.log").read_text()
        assert not any(" INFO " in x and "AFD" not in x for x in run.lines), run.lines
        out = complete(url, served_model(url), "hello", 4, stream=False)
        assert len(out.token_ids) == 4
        groups = run.role_groups()
        assert len(groups) == 2  # the attention server and the FFN server
        sockets = listening(members(groups))
        ports = {port for _, port, _ in sockets}
        assert {run.port, run.ffn_port, run.afd_port + 1} <= ports, sockets
        wide = [s for s in sockets if s[0] not in LOOPBACK]
        assert not wide, f"listening beyond loopback: {wide}"
        start_log = "".join(run.lines) + attention_log
        start_log += (tmp_path / "ffn.log").read_text()
        assert "model_class_overrides" not in start_log
        assert "development/debugging" not in start_log
        n = len(run.lines)
        logs = [tmp_path / "attention.log", tmp_path / "ffn.log"]
        sizes = [log.stat().st_size for log in logs]
        t0 = time.monotonic()
        os.kill(run.proc.pid, signal.SIGTERM)
        assert run.proc.wait(60) == 0
        stopped = time.monotonic() - t0
        _wait_gone(groups, 10)
        stop_log = "".join(run.lines[n:]) + "".join(
            log.read_text()[size:] for log, size in zip(logs, sizes, strict=True)
        )
        for noise in ("Traceback", " ERROR ", "nanobind", "leaked"):
            assert noise not in stop_log, stop_log
        print(f"clean stop: launcher exited {stopped:.1f}s after SIGTERM")
    finally:
        run.cleanup()


def test_a_role_failing_at_start_names_its_cause(model, tmp_path):
    """The attention role asks for 99.9 % of the RAM (vLLM's own check fails
    in its worker): the launcher's error is that role's first exception
    line, not "exited with code 1", with the path of its full log."""
    run = Launched(
        model, "--log-dir", str(tmp_path),
        "--attention-args", "--gpu-memory-utilization 0.999",
        env=_own_memory_sizing(),
    )  # fmt: skip
    try:
        assert run.proc.wait(READY_TIMEOUT_S) == 1
        run.wait_line("", 1)  # the reader has seen the end
        error = run.wait_line(r"vllm-afd launch: the attention process exited", 5)
        assert "ValueError: Available memory on node" in error, error
        assert f"(full log: {tmp_path / 'attention.log'})" in error, error
        assert len(run.lines) < 40, "".join(run.lines)
    finally:
        run.cleanup()


def test_sigkilled_launcher_leaves_no_role_running(model):
    run = Launched(model, "--verbose")
    try:
        run.wait_line(r"ready: http", READY_TIMEOUT_S)
        groups = run.role_groups()
        assert len(members(groups)) >= 4  # servers, engine cores, workers
        killed = time.monotonic()
        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait(10)
        gone = _wait_gone(groups, GONE_AFTER_KILL_S)
        # a socket is released a moment after its last holder exits
        ports = (run.port, run.ffn_port, run.afd_port + 1)
        while not all(map(_bindable, ports)):
            if time.monotonic() - killed > GONE_AFTER_KILL_S:
                held = [p for p in ports if not _bindable(p)]
                holders = listening(live_pids())
                pytest.fail(
                    f"ports {held} still held {GONE_AFTER_KILL_S:.0f}s after the "
                    f"SIGKILL; listeners: {[h for h in holders if h[1] in held]}"
                )
            time.sleep(0.1)
        print(
            f"launcher SIGKILL: every role process gone after {gone:.1f}s, "
            f"its ports free after {time.monotonic() - killed:.1f}s"
        )
    finally:
        run.cleanup()


def test_sigterm_while_the_roles_start_stops_them_all(model):
    run = Launched(model, "--verbose")
    try:
        deadline = time.monotonic() + 60
        while len(run.role_groups()) < 2:
            assert time.monotonic() < deadline and run.proc.poll() is None
            time.sleep(0.1)
        groups = run.role_groups()
        run.wait_line(r"\[(ffn|attention)\].*(Loading|Initializ)", 120)
        assert not any("ready: http" in x for x in run.lines)
        t0 = time.monotonic()
        os.kill(run.proc.pid, signal.SIGTERM)
        assert run.proc.wait(STOPPED_AFTER_TERM_S) == 0
        _wait_gone(groups, 10)
        took = time.monotonic() - t0
        assert took < STOPPED_AFTER_TERM_S
        print(f"SIGTERM during start-up: every process gone after {took:.1f}s")
    finally:
        run.cleanup()


def _ffn_server_in_the_rendezvous(model: Path) -> tuple[subprocess.Popen, int]:
    """An FFN server started by hand, its worker waiting in the rendezvous
    for an attention peer that never comes; (server, afd.port)."""
    afd_port = free_port_pair()
    (port,) = [p for p in free_ports(3) if p not in (afd_port, afd_port + 1)][:1]
    argv = [
        sys.executable, "-m", "vllm_afd.cli.main", "serve", str(model),
        "--host", "127.0.0.1", "--port", str(port), *VLLM_ARGS,
        "--additional-config",
        f'{{"afd": {{"role": "ffn", "port": {afd_port}}}}}',
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("AFD_")}
    server = Collected(argv, env=env)
    try:
        server.wait_line("ffn rank 0 listening on", READY_TIMEOUT_S)
    except AssertionError:
        server.proc.kill()
        raise
    assert len(members({server.proc.pid})) >= 3  # server, engine core, worker
    return server.proc, afd_port


def test_a_server_killed_in_the_rendezvous_takes_its_engine_with_it(model):
    """An FFN server started by hand waits for its attention peer. SIGKILL
    the server alone (the OOM killer's way): its engine core and worker,
    vLLM's own children, exit within the lifeline's grace, and the rendezvous
    port is free again."""
    sig = signal.SIGKILL
    server, afd_port = _ffn_server_in_the_rendezvous(model)
    try:
        t0 = time.monotonic()
        server.send_signal(sig)  # the server alone, not its group
        server.wait(10)
        _wait_gone({server.pid}, LIFELINE_GRACE_S + 5)
        took = time.monotonic() - t0
        assert _bindable(afd_port), "the rendezvous port is still held"
        print(f"server {sig.name} in the rendezvous: all gone after {took:.1f}s")
    finally:
        if server.poll() is None:
            server.kill()
        for pid in members({server.pid}):
            os.kill(pid, signal.SIGKILL)
