"""Start ``vllm-afd serve`` processes from one that has imported vLLM already.

A role process spends about 10 s of a core importing vLLM, torch and
transformers before it reads its arguments; the end-to-end suite starts
~95 of them. This process imports them once (as ``vllm-afd serve`` would,
with the same environment) and forks a child per start, which runs
``python -m MODULE ARGS`` from there (``vllm_afd.cli.main serve …``: the same
``main``), in a session of its own, its stdout and stderr the pipe the
caller gave, its environment the caller's. What a role does after its
imports, the processes vLLM spawns included (they start from a fresh
interpreter, as always), is unchanged. The harness keeps one fork server
per environment (less the ``AFD_*`` and ``PYTEST_*`` variables and vLLM's
``VLLM_RPC_BASE_PATH``: read when used, never at import), so that no module
read at import a value that another start would have set otherwise.

    python fork_server.py SOCKET_PATH

Protocol, one connection per start: the caller sends one byte with the write
end of the child's output pipe attached (``SCM_RIGHTS``), then an 8-byte
length and a JSON object ``{"module": str, "argv": [...], "env": {...},
"cwd": str}`` (``argv``: the arguments after ``-m MODULE``); this process
answers ``pid N`` and, when the child has exited, ``exit CODE`` (as
``Popen.returncode``: negative for a signal), one line each.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import sys
import traceback


def _preload() -> None:
    from vllm_afd.cli.vllm_cli import use_installed_vllm_version

    use_installed_vllm_version()
    import vllm.entrypoints.cli.main  # noqa: F401
    import vllm.entrypoints.cli.serve  # noqa: F401
    import vllm.entrypoints.openai.api_server  # noqa: F401


def _fork_engine_cores() -> None:
    """Fork the engine core from the role process, as vLLM does on a GPU host
    where nothing initialized CUDA yet, instead of spawning it (vLLM's CPU
    platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn``): the engine core then
    starts with vLLM imported, not after ~8 s of a core importing it again.
    Processes the engine core starts itself (tensor-parallel workers, which
    set their OpenMP environment before they start) are spawned as before."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.engine.core import EngineCoreProc

    import vllm_afd

    check = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]
    run = EngineCoreProc.run_engine_core

    def check_then_fork(cls, vllm_config) -> None:
        check(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    def run_spawning(*args, **kwargs):
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        # the plugin's registration as a spawned engine core runs it: this
        # process is one of an AFD server's now (``AFD_SERVER_PID``)
        vllm_afd._registered = False
        vllm_afd.register()
        return run(*args, **kwargs)

    CpuPlatform.check_and_update_config = classmethod(check_then_fork)  # type: ignore[method-assign]
    EngineCoreProc.run_engine_core = staticmethod(run_spawning)  # type: ignore[method-assign]


def _read_request(conn: socket.socket) -> tuple[int, dict]:
    _, fds, _, _ = socket.recv_fds(conn, 1, 1)
    if len(fds) != 1:
        raise ValueError(f"expected one file descriptor, got {len(fds)}")
    head = b""
    while len(head) < 8:
        chunk = conn.recv(8 - len(head))
        if not chunk:
            raise ValueError("connection closed before the request's length")
        head += chunk
    size, body = int.from_bytes(head, "big"), b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ValueError("connection closed inside the request")
        body += chunk
    return fds[0], json.loads(body)


def _child(output: int, request: dict, inherited: list[int]) -> None:
    """In the forked child: become ``python -m MODULE ARGV``."""
    import runpy

    code = 1
    try:
        # ps shows the command, not ours (before the environment changes: the
        # title takes the memory of the original argv and environment)
        with contextlib.suppress(ImportError):
            import setproctitle

            setproctitle.setproctitle(
                " ".join([sys.executable, "-m", request["module"], *request["argv"]])
            )
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in inherited:
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(devnull)
        os.close(output)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = ["-m", *request["argv"]]
        if os.environ.get("AFD_TEST_SPAWN_ENGINES") != "1" and BARE not in os.environ:
            _fork_engine_cores()
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


#: set (to any value) in a fork server's environment: it imports nothing
#: and its children run as they are (the suite's tests of the fork servers
#: themselves, whose probes need no vLLM); keyed like any other variable, so
#: such a server never starts a role
BARE = "FORK_SERVER_BARE"


def serve(path: str) -> None:
    if BARE not in os.environ:
        _preload()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    print(f"fork server ready on {path} (pid {os.getpid()})", flush=True)
    while True:
        for key, _ in sel.select(timeout=1.0):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    output, request = _read_request(conn)
                except (OSError, ValueError) as e:
                    print(f"bad request: {e}", flush=True)
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                inherited = [listener.fileno(), wake_r, wake_w, conn.fileno()]
                inherited += [c.fileno() for c in children.values()]
                pid = os.fork()
                if pid == 0:
                    _child(output, request, inherited)
                os.close(output)
                children[pid] = conn
                conn.sendall(f"pid {pid}\n".encode())
            else:
                os.read(wake_r, 4096)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                code = os.waitstatus_to_exitcode(status)
                with contextlib.suppress(OSError):  # the caller went away
                    conn.sendall(f"exit {code}\n".encode())
                conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
