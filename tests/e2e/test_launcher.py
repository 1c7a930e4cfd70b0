"""No role outlives its launcher: SIGKILL ``vllm-afd launch`` once it is ready
and every role process (API servers, engine cores, workers) is gone within
seconds, its ports free again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from harness import free_port_pair, free_ports

from vllm_afd.models.tiny_checkpoint import write_tiny_checkpoint

pytestmark = pytest.mark.e2e

READY_TIMEOUT_S = 420.0
GONE_WITHIN_S = 15.0


def _processes() -> dict[int, tuple[str, int, bytes]]:
    """pid -> (state, process group, command line) of every live process."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if stat[0] != "Z":
            found[int(entry.name)] = (stat[0], int(stat[2]), cmdline)
    return found


def _role_groups(model: Path) -> set[int]:
    """Process groups of the role servers (each its own session)."""
    return {g for _, g, cmd in _processes().values() if str(model).encode() in cmd}


def _members(groups: set[int]) -> list[int]:
    return [pid for pid, (_, g, _) in _processes().items() if g in groups]


def test_sigkilled_launcher_leaves_no_role_running(tmp_path):
    model = write_tiny_checkpoint(tmp_path / "launched", arch="qwen3_moe", num_layers=2)
    afd_port = free_port_pair()
    port, ffn_port = [p for p in free_ports(4) if p not in (afd_port, afd_port + 1)][:2]
    argv = [
        sys.executable, "-m", "vllm_afd.cli.main", "launch", str(model),
        "--port", str(port), "--ffn-port", str(ffn_port), "--afd-port", str(afd_port),
        "--", "--enforce-eager", "--dtype", "float32", "--max-model-len", "512",
    ]  # fmt: skip
    launcher = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    ready = threading.Event()
    lines: list[str] = []

    def read() -> None:
        for line in launcher.stdout:
            lines.append(line)
            if "ready: http" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(READY_TIMEOUT_S), "".join(lines[-60:])
        groups = _role_groups(model) - {launcher.pid}
        assert len(groups) == 2, groups  # the attention and the FFN server
        # API servers, engine cores and workers
        assert len(_members(groups)) >= 4, _members(groups)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        deadline = time.monotonic() + GONE_WITHIN_S
        while _members(groups) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _members(groups)
        assert not left, f"running {GONE_WITHIN_S}s after the launcher died: {left}"
    finally:
        for pid in _members(_role_groups(model)):
            os.kill(pid, signal.SIGKILL)


def test_sigterm_during_start_up_stops_every_role_within_seconds(tmp_path):
    """SIGTERM while the roles start (before the ready line): the launcher
    stops them all and exits 0 well within its 30 s per-role stop bound."""
    model = write_tiny_checkpoint(tmp_path / "starting", arch="qwen3_moe", num_layers=2)
    afd_port = free_port_pair()
    port, ffn_port = [p for p in free_ports(4) if p not in (afd_port, afd_port + 1)][:2]
    argv = [
        sys.executable, "-m", "vllm_afd.cli.main", "launch", str(model),
        "--port", str(port), "--ffn-port", str(ffn_port), "--afd-port", str(afd_port),
        "--", "--enforce-eager", "--dtype", "float32", "--max-model-len", "512",
    ]  # fmt: skip
    launcher = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(_role_groups(model) - {launcher.pid}) < 2:
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.2)
        groups = _role_groups(model) - {launcher.pid}
        time.sleep(3)  # the roles are loading vLLM, not ready yet
        os.kill(launcher.pid, signal.SIGTERM)
        t0 = time.monotonic()
        assert launcher.wait(45) == 0
        while _members(groups) and time.monotonic() - t0 < 45:
            time.sleep(0.2)
        assert not _members(groups), _members(groups)
        assert time.monotonic() - t0 < 40
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in _members(_role_groups(model)):
            os.kill(pid, signal.SIGKILL)
