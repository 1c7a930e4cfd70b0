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
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from vllm_afd import envs

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


#: the end-to-end figures (``harness.Results``) printed at the end
RESULT_TITLES = {
    "families": "AFD model families (identical greedy / bytes)",
    "hosts": "AFD across emulated hosts (identical greedy / start-up)",
    "faults": "AFD faults (seconds from the fault)",
    "plan": "vllm-afd plan (predicted vs measured)",
}


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
    for module, n in modules.most_common():
        terminalreporter.write_line(f"  {n:3d}  {module}")


def pytest_unconfigure(config):
    if _MINE:
        import shutil

        shutil.rmtree(_SESSION, ignore_errors=True)
