"""The metrics directory of a server killed without cleanup is removed by
the next server of the same pid namespace, and only then."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from vllm_afd.compat import metrics_dir


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _dir(root: Path, namespace: str, pid: int) -> Path:
    path = root / f"{metrics_dir.PREFIX}{namespace}-{pid}-abc123"
    path.mkdir()
    (path / f"counter_{pid}.db").write_bytes(b"\0" * 16)
    return path


def test_only_the_directories_of_dead_servers_of_this_namespace_go(tmp_path):
    here = metrics_dir._pid_namespace()
    dead = _dir(tmp_path, here, _dead_pid())
    live = _dir(tmp_path, here, os.getpid())
    elsewhere = _dir(tmp_path, str(int(here) + 1), _dead_pid())
    unnamed = tmp_path / f"{metrics_dir.PREFIX}xyz"  # not ours to judge
    unnamed.mkdir()
    assert metrics_dir.remove_stale(tmp_path) == [dead]
    assert not dead.exists()
    assert live.exists() and elsewhere.exists() and unnamed.exists()


def test_a_new_directory_names_its_server_and_clears_dead_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = _dir(tmp_path, metrics_dir._pid_namespace(), _dead_pid())
    path = Path(metrics_dir.make())
    assert path.is_dir() and path.parent == tmp_path
    match = metrics_dir._NAME.match(path.name)
    assert match and int(match[2]) == os.getpid()
    assert not dead.exists()
    assert metrics_dir.remove_stale(tmp_path) == []  # its own stays
