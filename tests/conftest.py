"""The whole suite: how many servers it started and how long it took.

Every ``vllm-afd serve`` process appends a line to the file named by
``AFD_SERVER_STARTS`` (``vllm_afd.envs``). Each test module points that
variable at a file of its own in the session's directory
(``AFD_TEST_SESSION_DIR``, made by the first process; a process pytest
starts inherits it), so the summary at the end counts the starts by role and
by module, beside the session's wall time, against the budget in
docs/testing.md. (A server a pool starts on a thread is counted for the test
that asked for it.) The end-to-end figures (``harness.Results``) are files
there too.

The suite can run in pytest-xdist workers (``make test TEST_WORKERS=2``, one
test file at a time each; CI runs one process). A test marked ``alone``
asserts times (faults: seconds from the signal to the error), so it runs
with no other worker's test beside it: every test holds the session's host
lock shared, an ``alone`` test holds it exclusively (a turnstile first, so a
waiting ``alone`` test is not starved).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from vllm_afd import envs

# OpenMP threads that have nothing to do sleep at once instead of spinning
# (GNU OpenMP's default spins a while): every vLLM process of the suite
# shares the host's two cores with other role processes, and a spinning
# thread took the cores its peer needed (an AFD workload beside two busy
# processes: 3.6 s instead of 1.1 s). Scheduling only; no number changes.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

#: the directory the session's processes write their figures to
SESSION_DIR_VAR = "AFD_TEST_SESSION_DIR"
_MINE = SESSION_DIR_VAR not in os.environ  # made here (removed at the end)
if _MINE:
    os.environ[SESSION_DIR_VAR] = tempfile.mkdtemp(prefix="afd-session-")
_SESSION = Path(os.environ[SESSION_DIR_VAR])
_STARTS = _SESSION / "starts"
_STARTS.mkdir(exist_ok=True)
_T0 = time.monotonic()


@pytest.fixture(scope="module", autouse=True)
def _count_server_starts(request):
    """Point ``AFD_SERVER_STARTS`` at this module's file (module scope and
    autouse: set before the module's other fixtures, which start servers)."""
    module = request.node.nodeid.split("::", 1)[0].replace("/", ".")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(envs.AFD_SERVER_STARTS, str(_STARTS / module))
        yield


#: how long a test waits for its turn on the host before failing
HOST_WAIT_S = 3600.0


def _flock(f, mode: int, what: str) -> None:
    """``flock`` ``f`` in ``mode``; fails after :data:`HOST_WAIT_S` naming
    ``what`` it waited for."""
    deadline = time.monotonic() + HOST_WAIT_S
    while True:
        try:
            fcntl.flock(f, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                pytest.fail(f"waited {HOST_WAIT_S:.0f}s for {what}")
            time.sleep(0.2)


@contextlib.contextmanager
def _host_share(alone: bool):
    """Hold the host shared, or alone (see the module doc)."""
    with (
        open(_SESSION / "host.turnstile", "a") as gate,
        open(_SESSION / "host.lock", "a") as host,
    ):
        _flock(gate, fcntl.LOCK_EX, "the host turnstile (an alone test holds it)")
        if alone:
            _flock(host, fcntl.LOCK_EX, "the other workers' tests to end")
            fcntl.flock(gate, fcntl.LOCK_UN)
        else:
            fcntl.flock(gate, fcntl.LOCK_UN)
            _flock(host, fcntl.LOCK_SH, "the host (an alone test holds it)")
        try:
            yield
        finally:
            if not alone and (harness := sys.modules.get("harness")) is not None:
                # a deployment a test began starting for the next one starts
                # now, not beside an alone test
                harness.POOL.settle()
            fcntl.flock(host, fcntl.LOCK_UN)


#: test files by their measured cost, most first (docs/testing.md): a worker
#: takes the next file in collection order (``--no-loadscope-reorder``), so
#: the longest start first, the many short files fill the gaps, and the
#: ``alone`` files come last, when no other file is left to wait for them
LONGEST_FIRST = (
    "test_plan", "test_families", "test_pd", "test_scale_out",
    "test_gate_on_attention", "test_exact_1a1f", "test_multi_host",
    "test_demo", "test_bench", "test_tiny_model_hf_parity",
)  # fmt: skip


def pytest_collection_modifyitems(session, config, items):
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) < 2:
        return  # one process: the files in their own order

    def order(item) -> tuple[int, int]:
        if item.get_closest_marker("alone") is not None:
            return (2, 0)
        name = item.path.stem
        return (0, LONGEST_FIRST.index(name)) if name in LONGEST_FIRST else (1, 0)

    items.sort(key=order)  # stable: a file's tests keep their order


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with _host_share(item.get_closest_marker("alone") is not None):
        return (yield)


#: the end-to-end figures (``harness.Results``) printed at the end
RESULT_TITLES = {
    "families": "AFD model families (identical greedy / bytes)",
    "hosts": "AFD across emulated hosts (identical greedy / start-up)",
    "faults": "AFD faults (seconds from the fault)",
    "plan": "vllm-afd plan (predicted vs measured)",
}

#: seconds of setup, call and teardown by test module (this process's tests)
_SECONDS: Counter[str] = Counter()


def pytest_runtest_logreport(report):
    _SECONDS[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter):
    for name, title in RESULT_TITLES.items():
        path = _SESSION / f"results-{name}"
        if path.exists():
            terminalreporter.section(title)
            for line in path.read_text().splitlines():
                terminalreporter.write_line(line)
    roles: Counter[str] = Counter()
    modules: Counter[str] = Counter()
    for path in sorted(_STARTS.iterdir()):
        lines = path.read_text().splitlines()
        roles.update(line.split(" ", 1)[0] for line in lines)
        modules[path.name.removesuffix(".py").removeprefix("tests.")] = len(lines)
    by_role = ", ".join(f"{role} {n}" for role, n in sorted(roles.items()))
    terminalreporter.section("suite cost")
    terminalreporter.write_line(
        f"servers started: {roles.total()}"
        + (f" ({by_role})" if by_role else "")
        + f"; wall time {time.monotonic() - _T0:.0f}s"
    )
    forks = _SESSION / "forks"
    if forks.exists():
        counts = [line.split() for line in forks.read_text().splitlines()]
        terminalreporter.write_line(
            f"fork servers: {sum(int(s) for s, _ in counts)}, role processes "
            f"forked from them: {sum(int(f) for _, f in counts)}"
        )
    for module, n in modules.most_common():
        terminalreporter.write_line(f"  {n:3d}  {module}")
    if _SECONDS:
        terminalreporter.write_line("seconds by test file (this process):")
        for path, seconds in _SECONDS.most_common():
            terminalreporter.write_line(f"  {seconds:6.0f}  {path}")


def pytest_unconfigure(config):
    if _MINE:
        import shutil

        shutil.rmtree(_SESSION, ignore_errors=True)
