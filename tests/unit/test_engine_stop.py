"""The engine-process shutdown window of an AFD role (``compat.engine_stop``),
wrapped around vLLM's own function."""

from __future__ import annotations

import pytest

from vllm_afd.compat.engine_stop import (
    ENGINE_STOP_GRACE_S,
    SHUTDOWN_TIMEOUT,
    with_grace,
)
from vllm_afd.compat.patching import check_patch


@pytest.mark.parametrize(
    ("request_timeout", "process_timeout", "expected"),
    [
        # vLLM's default stop: abort requests, kill at once -> the grace
        (0, 0, ENGINE_STOP_GRACE_S),
        # an outer budget shorter than the grace is raised to it
        (0, 2.0, ENGINE_STOP_GRACE_S),
        # a longer process timeout stays
        (0, 12.0, 12.0),
        # no process timeout: vLLM's best-effort 5 s applies, unchanged
        (0, None, None),
        # a drain time asked for: vLLM's deadline, even a spent one, is kept
        (10, 3.0, 3.0),
        (10, 0, 0),
    ],
)
def test_the_grace_applies_only_without_a_drain_time(
    request_timeout, process_timeout, expected
):
    wrapped = with_grace(check_patch(SHUTDOWN_TIMEOUT))
    assert wrapped(request_timeout, process_timeout) == expected
