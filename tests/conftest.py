"""The whole suite: how many servers it started and how long it took.

Every ``vllm-afd serve`` process appends a line to the file named by
``AFD_SERVER_STARTS`` (``vllm_afd.envs``). Each test module points that
variable at a file of its own, so the summary at the end counts the starts by
role and by module, beside the session's wall time, against the budget in
docs/testing.md. (A server a pool starts on a thread is counted for the test
that asked for it.)
"""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from vllm_afd import envs

_STARTS = Path(tempfile.mkdtemp(prefix="afd-starts-"))
_T0 = time.monotonic()


@pytest.fixture(scope="module", autouse=True)
def _count_server_starts(request):
    """Point ``AFD_SERVER_STARTS`` at this module's file (module scope and
    autouse: set before the module's other fixtures, which start servers)."""
    module = request.node.nodeid.split("::", 1)[0].replace("/", ".")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(envs.AFD_SERVER_STARTS, str(_STARTS / module))
        yield


def pytest_terminal_summary(terminalreporter):
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
