"""The whole suite: how it is spread over two workers, how many servers it
started and how long it took.

``make test`` runs pytest with two workers (pytest-xdist, ``--dist loadfile
--no-loadscope-reorder``): one worker runs a test module whole (an end-to-end
module's deployments, and the pool and plain baselines of its worker, stay
together), the most expensive end-to-end modules first (:data:`E2E_COST`,
the collection order the workers take modules in). A server start is mostly
one core's work (imports), so two streams keep the two cores busy.

Every ``vllm-afd serve`` process appends a line to the file named by
``AFD_SERVER_STARTS`` (``vllm_afd.envs``). Each test module points that
variable at a file of its own in the session's directory
(``AFD_TEST_SESSION_DIR``, made by the first process and inherited by the
workers), so the summary at the end counts the starts by role and by module,
beside the session's wall time, against the budget in docs/testing.md. (A
server a pool starts on a thread is counted for the test that asked for it.)
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from vllm_afd import envs

#: the directory every worker of the session writes its figures to
SESSION_DIR_VAR = "AFD_TEST_SESSION_DIR"
if SESSION_DIR_VAR not in os.environ:  # the first process; workers inherit it
    os.environ[SESSION_DIR_VAR] = tempfile.mkdtemp(prefix="afd-session-")
_SESSION = Path(os.environ[SESSION_DIR_VAR])
_STARTS = _SESSION / "starts"
_STARTS.mkdir(exist_ok=True)
_T0 = time.monotonic()

#: seconds each end-to-end module took in a full run on two cores, the most
#: expensive first: the order the workers take them in (a module not listed
#: goes after these)
E2E_COST = {
    "test_families.py": 675,
    "test_scale_out.py": 316,
    "test_exact_1a1f.py": 309,
    "test_faults.py": 205,
    "test_plan.py": 165,
    "test_pd.py": 150,
    "test_multi_host.py": 126,
    "test_launcher.py": 114,
    "test_gate_on_attention.py": 112,
    "test_bench.py": 80,
    "test_demo.py": 50,
    "test_baseline.py": 40,
    "test_model_identity.py": 35,
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The expensive end-to-end modules first (xdist hands out modules in
    the order of the collection)."""
    rank = {name: i for i, name in enumerate(E2E_COST)}

    def order(item) -> tuple[int, int]:
        path = Path(str(item.fspath))
        if path.parent.name != "e2e":
            return (1, 0)
        return (0, rank.get(path.name, len(rank)))

    items.sort(key=order)  # stable: a module's own order is kept


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
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
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
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        import shutil

        shutil.rmtree(_SESSION, ignore_errors=True)
