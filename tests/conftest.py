"""The whole suite: how many servers it started and how long it took.

Every ``vllm-afd serve`` process appends a line to the file named by
``AFD_SERVER_STARTS`` (``vllm_afd.envs``); the summary at the end counts them
by role, beside the session's wall time, against the budget in
docs/testing.md.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import Counter
from pathlib import Path

from vllm_afd import envs

_STARTS = Path(tempfile.mkdtemp(prefix="afd-starts-")) / "starts"
os.environ.setdefault(envs.AFD_SERVER_STARTS, str(_STARTS))
_T0 = time.monotonic()


def pytest_terminal_summary(terminalreporter):
    path = Path(os.environ[envs.AFD_SERVER_STARTS])
    lines = path.read_text().splitlines() if path.is_file() else []
    roles = Counter(line.split(" ", 1)[0] for line in lines)
    by_role = ", ".join(f"{role} {n}" for role, n in sorted(roles.items()))
    terminalreporter.section("suite cost")
    terminalreporter.write_line(
        f"servers started: {len(lines)}"
        + (f" ({by_role})" if by_role else "")
        + f"; wall time {time.monotonic() - _T0:.0f}s"
    )
