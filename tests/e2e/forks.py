"""``vllm-afd serve`` processes started from fork servers (``fork_server.py``).

:func:`install` makes :data:`vllm_afd.deploy.process.spawn` start every
``python -m vllm_afd.cli.main serve …`` from a fork server that imported vLLM
once; any other command (the router, ``ip netns exec …``) is started as
before. One fork server per environment less its :data:`UNKEYED` variables, started
on first use and stopped by :func:`close`. A :class:`ForkedProcess` stands for
the ``Popen`` of the child: ``pid``, ``returncode``, ``poll``, ``wait``,
``stdout`` and signals, the child in a session of its own (``os.killpg`` on
its pid reaches its group, as with ``start_new_session``).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from vllm_afd.deploy import process

#: seconds a fork server may take to import vLLM and listen
READY_S = 180.0
#: variables read when used, never at import (this project's; pytest's name
#: of the running test; vLLM's socket directory and development endpoints,
#: read as a server starts): a fork server serves every value of them
UNKEYED = ("AFD_", "PYTEST_", "VLLM_RPC_BASE_PATH", "VLLM_SERVER_DEV_MODE")
#: fork servers kept at once (~0.6 GB each): beyond it the least recently
#: used with no child running are stopped
KEEP = 3
#: the commands started from a fork server: what ``serve_argv`` builds
SERVE = [sys.executable, "-m", "vllm_afd.cli.main", "serve"]


class ForkedProcess:
    """A child of a fork server, seen as the ``Popen`` of it would be."""

    def __init__(self, path: str, argv: list[str], env: dict[str, str]) -> None:
        """``argv``: ``[sys.executable, "-m", MODULE, *ARGS]``."""
        if argv[:2] != [sys.executable, "-m"] or len(argv) < 3:
            raise ValueError(f"not a python -m command: {argv}")
        self.args = argv
        self.returncode: int | None = None
        self._lock = threading.Lock()
        self._buf = b""
        read, write = os.pipe()
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(path)
            socket.send_fds(self._conn, [b"F"], [write])
            body = json.dumps(
                {"module": argv[2], "argv": argv[3:], "env": env, "cwd": os.getcwd()}
            )
            data = body.encode()
            self._conn.sendall(len(data).to_bytes(8, "big") + data)
        finally:
            os.close(write)
        self.stdout: IO[bytes] = os.fdopen(read, "rb")
        line = self._line(60.0)
        if line is None or not line.startswith("pid "):
            raise RuntimeError(f"the fork server at {path} answered {line!r}")
        self.pid = int(line.split()[1])

    def _line(self, timeout: float | None) -> str | None:
        """The next line from the fork server within ``timeout``, else None."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return None
            chunk = self._conn.recv(4096)
            if not chunk:
                raise RuntimeError(
                    f"the fork server of {self.args} closed before the child "
                    "exited (stopped while its children ran?)"
                )
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode()

    def _read_exit(self, timeout: float | None) -> int | None:
        """The exit code, read from the fork server within ``timeout`` if
        not yet known (the caller holds the lock); None while it runs."""
        if self.returncode is None:
            line = self._line(timeout)
            if line is not None:
                self.returncode = int(line.split()[1])
                self._conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._lock:
            code = self._read_exit(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def poll(self) -> int | None:
        """The exit code, or None while it runs; never blocks (a thread in
        :meth:`wait` reads the code for both)."""
        if not self._lock.acquire(blocking=False):
            return self.returncode
        try:
            return self._read_exit(0.0)
        finally:
            self._lock.release()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@dataclass
class _Server:
    proc: subprocess.Popen[bytes]
    path: str
    children: list[ForkedProcess] = field(default_factory=list)

    def idle(self) -> bool:
        """No child of it runs (it can be stopped: a child's exit code comes
        from it)."""
        return all(child.poll() is not None for child in self.children)


class ForkServers:
    """The session's fork servers, one per environment less :data:`UNKEYED`."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="afd-forks-"))
        self._servers: dict[tuple, _Server] = {}
        self._lock = threading.Lock()
        self.started = 0  # fork servers
        self.forked = 0  # processes forked from them

    def __len__(self) -> int:
        return len(self._servers)

    def _server(self, env: dict[str, str]) -> _Server:
        key = tuple(sorted((k, v) for k, v in env.items() if not k.startswith(UNKEYED)))
        with self._lock:
            running = self._servers.pop(key, None)
            if running is not None and running.proc.poll() is None:
                self._servers[key] = running  # the most recently used last
                return running
            # the least recently used idle ones beyond KEEP
            idle = [k for k, server in self._servers.items() if server.idle()]
            for old in idle[: max(0, len(self._servers) + 1 - KEEP)]:
                self._stop(self._servers.pop(old))
            n = self.started
            self._dir.mkdir(mode=0o700, exist_ok=True)  # again after close()
            path = str(self._dir / f"s{n}.sock")
            log = self._dir / f"s{n}.log"
            with log.open("ab") as out:
                proc = subprocess.Popen(
                    [sys.executable, str(Path(__file__).with_name("fork_server.py")),
                     path],
                    env=dict(key), stdout=out, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                )  # fmt: skip
            self.started += 1
            deadline = time.monotonic() + READY_S
            while not os.path.exists(path):
                if proc.poll() is not None or time.monotonic() > deadline:
                    self._stop(_Server(proc, path))
                    raise RuntimeError(
                        f"fork server {n} did not listen within {READY_S:.0f}s "
                        f"(exit {proc.poll()}): {log.read_text()[-2000:]}"
                    )
                time.sleep(0.1)
            server = _Server(proc, path)
            self._servers[key] = server
            return server

    @staticmethod
    def _stop(server: _Server) -> None:
        """Stop a fork server (a child still running lives on in its own
        session, but its exit code is lost: :meth:`_server` stops idle ones)."""
        server.proc.kill()
        server.proc.wait(10)

    def spawn(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        if argv[: len(SERVE)] != SERVE:
            return process.popen(argv, env)
        return self.fork(argv, env)  # type: ignore[return-value]

    def fork(self, argv: list[str], env: dict[str, str]) -> ForkedProcess:
        """``argv`` (``python -m MODULE ARGS``) forked from the fork server of
        ``env``."""
        self.forked += 1
        server = self._server(env)
        child = ForkedProcess(server.path, argv, env)
        with self._lock:
            server.children = [c for c in server.children if c.returncode is None]
            server.children.append(child)
        return child

    def close(self) -> None:
        """Stop every fork server and remove their sockets and logs."""
        with self._lock:
            for server in self._servers.values():
                self._stop(server)
            self._servers.clear()
            shutil.rmtree(self._dir, ignore_errors=True)


SERVERS = ForkServers()


def install() -> None:
    """Start ``vllm-afd serve`` processes from :data:`SERVERS` from now on."""
    process.spawn = SERVERS.spawn


def close() -> None:
    """Back to plain process starts; stop the fork servers and add their
    counts to ``AFD_TEST_SESSION_DIR``'s ``forks`` file (the summary's)."""
    process.spawn = process.popen
    SERVERS.close()
    if SERVERS.started:
        with (Path(os.environ["AFD_TEST_SESSION_DIR"]) / "forks").open("a") as f:
            f.write(f"{SERVERS.started} {SERVERS.forked}\n")
