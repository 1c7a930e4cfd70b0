"""One supervised role process (a ``vllm serve`` in a process group of
its own) and the errors of starting and supervising deployments.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from vllm_afd import envs
from vllm_afd.deploy.logs import TextSink, exception_of


def popen(argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A role process in a session (process group) of its own, its stdout
    and stderr one pipe."""
    return subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


#: how :meth:`RoleProcess.start` starts its process (:func:`popen`). The test
#: suite swaps in a fork server that has imported vLLM once for many
#: ``vllm-afd serve`` processes (``tests/e2e/fork_server.py``); what it
#: returns behaves as the ``Popen`` does for ``pid``, ``poll``, ``wait``,
#: ``stdout`` and signals.
spawn: Callable[[list[str], dict[str, str]], subprocess.Popen[bytes]] = popen


class LaunchError(RuntimeError):
    """A role process failed to start or died."""


class DeploymentEnded(LaunchError):
    """An FFN rank stopped by itself because its attention peers shut down
    for good: the deployment was stopped (from another node). Not a failure."""


@dataclass
class RoleProcess:
    """One supervised ``vllm serve`` process."""

    name: str  # attention, ffn, ffn1, ... (what supervision goes by)
    argv: list[str]
    port: int
    env: dict[str, str]
    host: str = "127.0.0.1"
    headless: bool = False  # vLLM --headless: no API server, nothing to probe
    # before the name where the process is shown (log lines, log file,
    # errors): "prefill-" for the roles of an AFD prefill deployment
    group: str = ""
    proc: subprocess.Popen[bytes] | None = None
    _pump: threading.Thread | None = None
    # supervision (Deployment.supervise): when the process last started,
    # whether it answered /health since, and when /health last answered
    started_at: float = 0.0
    healthy_since_start: bool = False
    last_healthy: float = 0.0
    restarts: int = 0  # in a row: reset once the rank ran STABLE_S
    restart_at: float | None = None
    # FFN: the file (AFD_STOP_NOTE) where the role says why it stopped for good
    stop_note: str | None = None
    # the role's full log (appended across restarts; None: console only) and
    # the first exception line of its output since it last started
    log_file: Path | None = None
    first_error: str | None = None
    # the directory of the server's ZMQ IPC sockets (vLLM's
    # VLLM_RPC_BASE_PATH): made at the first start, removed at stop
    rpc_dir: str | None = None

    @property
    def label(self) -> str:
        """The name this process is shown by: ``group`` + ``name``."""
        return f"{self.group}{self.name}"

    @property
    def is_ffn(self) -> bool:
        return self.name.startswith("ffn")

    @property
    def url(self) -> str:
        """Where this machine reaches the server's API."""
        return f"http://{connect_host(self.host)}:{self.port}"

    def start(self, log: TextSink | None) -> None:
        self.started_at = time.monotonic()
        self.healthy_since_start = False
        self.first_error = None
        env = self.env
        if self.is_ffn:
            if self.stop_note is None:
                fd, self.stop_note = tempfile.mkstemp(prefix=f"afd-{self.label}-")
                os.close(fd)
            Path(self.stop_note).write_text("")
            env = {**env, envs.AFD_STOP_NOTE: self.stop_note}
        if (
            RPC_PATH_VAR not in env
            and RPC_PATH_VAR not in os.environ
            and rpc_dir_fits(tempfile.gettempdir())
        ):
            # vLLM names its sockets in the system's temporary directory and
            # leaves them there when its processes end by a signal
            if self.rpc_dir is None:
                self.rpc_dir = tempfile.mkdtemp(prefix=RPC_DIR_PREFIX)
            env = {**env, RPC_PATH_VAR: self.rpc_dir}
        self.proc = spawn(self.argv, env)
        self._pump = threading.Thread(
            target=self._pump_lines, args=(self.proc.stdout, log), daemon=True
        )
        self._pump.start()

    def _pump_lines(self, stream: IO[bytes], log: TextSink | None) -> None:
        prefix = f"[{self.label}] "
        file = None if self.log_file is None else self.log_file.open("a")
        try:
            for raw in iter(stream.readline, b""):
                line = raw.decode(errors="replace")
                if self.first_error is None:
                    self.first_error = exception_of(line)
                if file is not None:
                    file.write(line)
                    file.flush()
                if log is not None:
                    try:
                        log.write(prefix + line)
                        log.flush()
                    except (ValueError, OSError):
                        # the caller closed its sink (it stopped watching this
                        # process): keep draining the pipe, so that the
                        # process never blocks writing to it
                        log = None
        finally:
            if file is not None:
                file.close()

    def exited(self, code: int | None) -> str:
        """``the NAME process exited with code N``, then the first exception
        line of its output (the cause) and where its full log is."""
        text = f"the {self.label} process exited with code {code}"
        if self._pump is not None:
            self._pump.join(5.0)  # its last lines, the traceback among them
        if self.first_error is not None:
            text += f": {self.first_error}"
        if self.log_file is not None:
            text += f" (full log: {self.log_file})"
        return text

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stopped_for_good(self) -> str | None:
        """FFN: why the role stopped its server because its attention peers
        shut down for good (``AFD_STOP_NOTE``); None if it did not."""
        note = self._stop_note()
        return None if note is None or note.startswith(envs.PEER_DIED) else note

    def peer_died(self) -> str | None:
        """FFN: which attention peer died, and how, when the role stopped its
        server for that (``AFD_STOP_NOTE``); None if it did not."""
        note = self._stop_note()
        if note is None or not note.startswith(envs.PEER_DIED):
            return None
        return note[len(envs.PEER_DIED) :]

    def _stop_note(self) -> str | None:
        if self.stop_note is None:
            return None
        try:
            return Path(self.stop_note).read_text() or None
        except OSError:
            return None

    def forget_stop_note(self) -> None:
        if self.stop_note is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.stop_note)
            self.stop_note = None

    def healthy(self) -> bool:
        if self.headless:
            return self.exit_code() is None
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout: float) -> None:
        """SIGTERM the role's process group (as Ctrl-C reaches every process
        of a terminal's job: the workers close their connectors, which tells
        the peers), SIGKILL the group when the server is not gone after
        ``timeout`` s, or what is left of it :data:`GROUP_GRACE_S` after."""
        self.request_stop()
        self.finish_stop(time.monotonic() + timeout)

    def request_stop(self) -> None:
        """SIGTERM the role's process group (first half of :meth:`stop`)."""
        if self.proc is not None and self.proc.poll() is None:
            signal_group(self.proc, signal.SIGTERM)

    def finish_stop(self, deadline: float) -> None:
        """Wait for the server until ``deadline`` (monotonic), then SIGKILL
        the group; what is left of it :data:`GROUP_GRACE_S` later too."""
        if self.proc is None:
            return
        try:
            self.proc.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            signal_group(self.proc, signal.SIGKILL)
            self.proc.wait(10)
        deadline = time.monotonic() + GROUP_GRACE_S
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        signal_group(self.proc, signal.SIGKILL)
        if self.rpc_dir is not None:
            shutil.rmtree(self.rpc_dir, ignore_errors=True)
            self.rpc_dir = None


GROUP_GRACE_S = 5.0
#: where vLLM puts its processes' ZMQ IPC sockets (default: the system's
#: temporary directory); a role process not given one gets a directory of
#: its own, removed when it stops
RPC_PATH_VAR = "VLLM_RPC_BASE_PATH"
#: the name of that directory: ``tempfile.mkdtemp`` adds 8 characters
RPC_DIR_PREFIX = "afd-"
#: a socket path's longest length (``sun_path`` is 108 bytes with its NUL)
UNIX_PATH_MAX = 107
#: what vLLM adds to its socket directory: ``/`` and a UUID
VLLM_SOCKET_NAME_LEN = 1 + 36
#: seconds a stop of a deployment still starting waits for every role (vLLM
#: defers SIGTERM while its API server waits for the engine to be ready)
STARTING_STOP_S = 5.0


def rpc_dir_fits(tmp: str) -> bool:
    """Whether vLLM's socket paths fit in a directory of our own under
    ``tmp``. Where they would not, a role leaves ``VLLM_RPC_BASE_PATH`` unset
    and vLLM names its sockets in ``tmp`` itself, as it would without AFD."""
    ours = len(os.path.join(tmp, RPC_DIR_PREFIX)) + 8
    return ours + VLLM_SOCKET_NAME_LEN <= UNIX_PATH_MAX


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``; on systems
    without ``/proc``, ``[pgid]`` while the group has any member."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [pgid]
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # after the command name, which may hold spaces and parentheses
            state, _ppid, group = (
                (entry / "stat").read_text().rsplit(")", 1)[1].split()[:3]
            )
        except (OSError, ValueError):
            continue
        if int(group) == pgid and state not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _group_alive(pgid: int) -> bool:
    return bool(group_members(pgid))


#: addresses a server binds on every interface of
WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def connect_host(bind_host: str) -> str:
    """The address a local client uses for a server bound to ``bind_host``."""
    if bind_host in WILDCARD_HOSTS:
        return "127.0.0.1"
    return f"[{bind_host}]" if ":" in bind_host else bind_host


def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
