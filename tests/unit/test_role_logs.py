"""Role logs: the cause of a failed start, a full log per role, a short console."""

from __future__ import annotations

import io
import os
import shutil
import sys
import tempfile
import time

import pytest

from vllm_afd.deploy import RoleProcess
from vllm_afd.deploy.logs import (
    ConsoleFilter,
    exception_of,
    is_exception_line,
    shown_on_console,
)
from vllm_afd.deploy.process import rpc_dir_fits

#: what vLLM 0.32.0 printed when the attention role could not get its memory
#: (shortened): the root cause first, then the generic wrappers
VLLM_FAILURE = [
    "(EngineCore pid=812) INFO 12-03 10:00:01 [core.py:99] Initializing",
    # a handled exception vLLM logs and goes on from (an optional kernel
    # package that did not import, as vLLM 0.32.0 logged it on an H100)
    "(EngineCore pid=812) WARNING 12-06 07:24:22 [import_utils.py:417] OSError: "
    "/site/vllm/third_party/deep_gemm/_C_extension.abi3.so: undefined symbol: "
    "torch_exception_get_what_without_backtrace",
    "(Worker pid=840) ERROR 12-03 10:00:02 [multiproc_executor.py:1] WorkerProc "
    "failed to start.",
    "(Worker pid=840) Traceback (most recent call last):",
    '(Worker pid=840)   File "cpu_worker.py", line 87, in __init__',
    "(VllmWorker-0 pid=840) ERROR 12-04 00:36:37 [multiproc_executor.py:953] "
    "ValueError: Available memory on node 0 (20.93/23.54 GiB) on startup is less "
    "than desired CPU memory utilization (0.92, 21.66 GiB).",
    "(EngineCore pid=812) RuntimeError: WorkerProc initialization failed due to an "
    "exception in a background process. See stack trace for root cause.",
    "RuntimeError: Engine core initialization failed. See root cause above.",
]


def test_the_first_exception_line_is_the_cause_not_vllms_wrappers():
    causes = [exception_of(line) for line in VLLM_FAILURE if is_exception_line(line)]
    assert causes == [VLLM_FAILURE[5][VLLM_FAILURE[5].index("ValueError") :]]


@pytest.mark.parametrize(
    "line,shown",
    [
        ("(APIServer pid=1) INFO 12-03 [api_server.py:1] Starting vLLM", False),
        ("(APIServer pid=1) WARNING 12-03 [cuda.py:2] Triton not found", False),
        (
            "(Worker pid=2) WARNING 12-03 [ffn_link.py:9] AFD attention rank 0: lost",
            True,
        ),
        (
            "(Worker pid=2) INFO 12-03 [connector.py:112] AFD connector up: role=ffn",
            True,
        ),
        ("(Worker pid=2) ERROR 12-03 [core.py:1] EngineCore failed", True),
        (
            "(EngineCore pid=5) ERROR 12-04 01:37:53 [core.py:1510] Traceback (most "
            "recent call last):",
            False,
        ),  # a traceback vLLM logs line by line:
        (
            "(EngineCore pid=5) ERROR 12-04 01:37:53 [core.py:1510]   File "
            '"core.py", line 1482, in run_engine_core',
            False,
        ),  # its frames hidden,
        (
            "(EngineCore pid=5) ERROR 12-04 01:37:53 [core.py:1510]            "
            "^^^^^^^^^",
            False,
        ),
        (
            "(VllmWorker-0 pid=7) ERROR 12-04 01:37:50 [multiproc_executor.py:953] "
            "ValueError: Available memory on node 0",
            True,
        ),  # its last line shown
        ("torch.OutOfMemoryError: CUDA out of memory", True),
        (
            "(EngineCore pid=5) WARNING 12-06 07:24:22 [import_utils.py:417] "
            "OSError: deep_gemm/_C_extension.abi3.so: undefined symbol",
            False,
        ),  # a handled exception, logged as a warning
        ('INFO:     127.0.0.1:1 - "GET /health HTTP/1.1" 200 OK', False),
    ],
)
def test_console_shows_errors_and_afd_lines_only(line, shown):
    assert shown_on_console(line) is shown
    out = io.StringIO()
    ConsoleFilter(out).write(f"[attention] {line}\n")
    assert (out.getvalue() != "") is shown


@pytest.fixture(autouse=True)
def _temporary_files_in_tmp_path(tmp_path, monkeypatch):
    """What a role process makes in the temporary directory (its vLLM socket
    directory, an FFN's stop note) goes to the test's own directory: most
    tests here let the process exit by itself and never stop it."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))


FAILING = """
import sys
print("INFO starting", flush=True)
print("Traceback (most recent call last):")
print("ValueError: Available memory on node 0 is less than desired", flush=True)
print("RuntimeError: Engine core initialization failed. See root cause above.")
sys.exit(1)
"""


def test_a_role_that_exits_names_its_cause_and_its_full_log(tmp_path):
    proc = RoleProcess(
        "attention", [sys.executable, "-c", FAILING], 1, {}, log_file=tmp_path / "a.log"
    )
    console = io.StringIO()
    proc.start(ConsoleFilter(console))
    deadline = time.monotonic() + 30
    while proc.exit_code() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    text = proc.exited(proc.exit_code())
    assert text == (
        "the attention process exited with code 1: ValueError: Available memory on "
        f"node 0 is less than desired (full log: {tmp_path / 'a.log'})"
    )
    log = (tmp_path / "a.log").read_text()
    assert "INFO starting" in log and "Engine core initialization failed" in log
    # The console got the exception lines, not the INFO line.
    assert "INFO starting" not in console.getvalue()
    assert "[attention] ValueError: Available memory" in console.getvalue()


def test_the_failed_role_is_named_even_when_its_peer_exits_first(tmp_path):
    """The FFN rank stops by itself (code 0) once its attention peer is gone;
    the attention role's traceback arrives a moment later: the error is the
    attention role's."""
    from vllm_afd.deploy import Deployment, DeploymentSpec, LaunchError

    spec = DeploymentSpec(model="m", cpu_workaround=False)
    deployment = Deployment(spec, log=None)
    late = "import time, sys; time.sleep(0.5); " + FAILING.strip().replace("\n", "; ")
    deployment.processes = [
        RoleProcess("ffn", [sys.executable, "-c", "pass"], 1, {}),
        RoleProcess(
            "attention", [sys.executable, "-c", late], 1, {},
            log_file=tmp_path / "attention.log",
        ),
    ]  # fmt: skip
    for proc in deployment.processes:
        proc.start(None)
    deadline = time.monotonic() + 30
    with pytest.raises(LaunchError) as err:
        while time.monotonic() < deadline:
            deployment.check_alive()
            time.sleep(0.05)
    assert str(err.value).startswith(
        "the attention process exited with code 1: ValueError: Available memory"
    ), err.value


def test_a_sink_closed_while_the_role_writes_is_dropped_and_the_pipe_drained(
    tmp_path,
):
    """The caller closes its console sink while the role still writes (a test
    or a launcher that stopped watching): the pump stops writing there, keeps
    its full log and drains the pipe, so the role is never blocked on it."""
    chatty = (
        "import sys, time\n"
        "for i in range(4000):\n"
        "    print('line', i, 'x' * 200, flush=True)\n"
        "    if i == 10: time.sleep(0.3)\n"
    )
    proc = RoleProcess(
        "ffn", [sys.executable, "-c", chatty], 1, {}, log_file=tmp_path / "f.log"
    )
    console = io.StringIO()
    proc.start(console)
    deadline = time.monotonic() + 10
    while "line 5 " not in console.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    console.close()  # 1 MiB still to come: more than a pipe holds
    assert proc.proc is not None and proc.proc.wait(30) == 0
    assert proc._pump is not None
    proc._pump.join(10)
    assert not proc._pump.is_alive()
    assert "line 3999 " in (tmp_path / "f.log").read_text()


#: a stand-in for vLLM's processes: binds a socket where vLLM would put its
#: ZMQ IPC sockets, says where, and runs until it is stopped (by a signal,
#: which leaves the socket file behind)
BINDS_A_SOCKET = """
import os, socket, time, uuid
path = os.path.join(os.environ["VLLM_RPC_BASE_PATH"], str(uuid.uuid4()))
socket.socket(socket.AF_UNIX).bind(path)
print("bound", path, flush=True)
time.sleep(120)
"""


def _bound_socket(console: io.StringIO, proc: RoleProcess) -> str:
    deadline = time.monotonic() + 30
    while "bound " not in console.getvalue():
        assert proc.exit_code() is None, console.getvalue()
        assert time.monotonic() < deadline, "the role never bound its socket"
        time.sleep(0.05)
    return console.getvalue().split("bound ", 1)[1].split()[0]


def test_a_role_keeps_vllms_sockets_in_a_directory_removed_at_stop(
    tmp_path, monkeypatch
):
    """vLLM leaves its ZMQ IPC sockets in the temporary directory when its
    processes end by a signal; each role process gets a directory of its own
    for them, and stopping the role removes it."""
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    # a temporary directory as short as a host's (vLLM names its sockets by
    # a UUID; the test's own directory may be too deep for a socket path)
    tmp = tempfile.mkdtemp(prefix="afd-test-", dir="/tmp")
    monkeypatch.setattr("tempfile.tempdir", tmp)
    try:
        proc = RoleProcess("attention", [sys.executable, "-c", BINDS_A_SOCKET], 1, {})
        console = io.StringIO()
        proc.start(console)
        path = _bound_socket(console, proc)
        assert os.path.dirname(path) == proc.rpc_dir
        assert os.path.basename(proc.rpc_dir).startswith("afd-")
        assert os.path.dirname(proc.rpc_dir) == tmp
        proc.stop(10)
        assert not os.path.exists(path)
        assert os.listdir(tmp) == []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_temporary_directory_too_deep_for_our_socket_directory_is_left_to_vllm(
    tmp_path, monkeypatch
):
    """Where vLLM's socket paths (a UUID each) would not fit in a directory
    of our own, the role leaves VLLM_RPC_BASE_PATH unset: vLLM uses the
    temporary directory itself, as without AFD."""
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    # 62 characters where the test's directory is shorter: vLLM's own socket
    # paths would fit there (at most 70), a directory of ours would not
    deep = tmp_path / ("d" * max(1, 62 - len(str(tmp_path)) - 1))
    deep.mkdir()
    assert not rpc_dir_fits(str(deep))
    assert rpc_dir_fits("/tmp")
    monkeypatch.setattr("tempfile.tempdir", str(deep))
    shows = 'import os; print("base", os.environ.get("VLLM_RPC_BASE_PATH"))'
    proc = RoleProcess("attention", [sys.executable, "-c", shows], 1, {})
    console = io.StringIO()
    proc.start(console)
    deadline = time.monotonic() + 30
    while "base " not in console.getvalue():
        assert time.monotonic() < deadline, "the role printed no line in 30 s"
        time.sleep(0.05)
    assert "base None" in console.getvalue() and proc.rpc_dir is None
    proc.stop(10)


def test_a_socket_directory_the_user_gives_is_used_and_kept(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    mine = tempfile.mkdtemp(prefix="afd-test-", dir="/tmp")  # short: see above
    try:
        env = {"VLLM_RPC_BASE_PATH": mine}
        argv = [sys.executable, "-c", BINDS_A_SOCKET]
        proc = RoleProcess("attention", argv, 1, env)
        console = io.StringIO()
        proc.start(console)
        assert os.path.dirname(_bound_socket(console, proc)) == mine
        proc.stop(10)
        assert proc.rpc_dir is None and os.path.isdir(mine)
    finally:
        shutil.rmtree(mine, ignore_errors=True)
