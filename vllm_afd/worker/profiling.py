"""Per-role ``torch.profiler`` traces of a few forward steps (a debug switch).

When ``AFD_PROFILE_DIR`` is set, a role process records ``AFD_PROFILE_STEPS``
steps (default 20; after ``AFD_PROFILE_SKIP`` steps, from the first served
step of ``AFD_PROFILE_TOKENS`` tokens when that is set) and writes a Chrome trace
``{AFD_PROFILE_DIR}/{role}-rank{rank}-pid{pid}.json`` (open it in Perfetto or
``chrome://tracing``). Unset, :meth:`StepProfiler.step` costs one attribute
check. Called by the attention worker once per ``begin_step`` and by the FFN
loop once per step::

    prof = StepProfiler("ffn", rank)      # reads AFD_PROFILE_DIR / _STEPS
    while plan := connector.recv_plan():
        prof.step()                      # call 1 starts; call N+1 exports
        ...
    prof.close()                         # same thread: a partial trace, if any

Each step is a ``afd_{role}_step#{k} step=ID tokens=N[+N] mode=MODE`` range in
the trace (``step_label``); ``tools/gpu/overlap_report.py`` reads the GPU
kernels of both roles' traces step by step. CPU activity is
always recorded, CUDA activity when a CUDA device is available. The trace
covers the threads the profiler sees; call ``step()`` from the thread that
runs the steps.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

from vllm_afd import envs

logger = logging.getLogger(__name__)


def step_label(plan: Any) -> str:
    """``step=12 tokens=64+64 mode=REPLAY``: the same on both roles for one
    step (the FFN's merged plan keeps the attention step id), so traces of
    the two roles can be matched step by step."""
    tokens = "+".join(str(n) for n in plan.ubatch_tokens)
    return f"step={plan.step_id} tokens={tokens} mode={plan.mode.name}"


def _capturing() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _is_step_of(plan: Any, tokens: int, modes: tuple[str, ...]) -> bool:
    """A step of ``tokens`` tokens in one of ``modes``."""
    if plan is None or plan.mode.name not in modes:
        return False
    return sum(plan.ubatch_tokens) == tokens


class StepProfiler:
    """Records ``steps`` steps of one role process, then writes a Chrome trace.

    Args:
        role: ``"attention"`` or ``"ffn"`` (names the file).
        rank: the role rank (names the file).
        out_dir: where to write; default ``envs.profile_dir()``. None: off.
        steps: steps to record; default ``envs.profile_steps()``.
        skip: calls to ignore before recording starts (e.g. warm-up steps).
        tokens: after the skipped calls, start at the first step whose plan
            has this many tokens in all and one of ``modes``; default
            ``envs.profile_tokens()``. None: any step.
        modes: the plan modes ``tokens`` accepts; default
            ``envs.profile_modes()`` (``EAGER`` and ``REPLAY``: served steps).

    Tracing is bound to a thread: the one that starts it stops it, and calls
    from other threads (vLLM runs micro-batches on threads of their own) are
    ignored, their GPU work landing in the step that is open.
    """

    def __init__(
        self,
        role: str,
        rank: int,
        out_dir: str | os.PathLike[str] | None = None,
        steps: int | None = None,
        skip: int = 0,
        tokens: int | None = None,
        modes: tuple[str, ...] | None = None,
    ) -> None:
        directory = out_dir if out_dir is not None else envs.profile_dir()
        self.role, self.rank = role, rank
        self.steps = steps if steps is not None else envs.profile_steps()
        self.path: Path | None = None
        if directory is not None:
            self.path = Path(directory) / f"{role}-rank{rank}-pid{os.getpid()}.json"
        self._skip = skip
        self._tokens = tokens if tokens is not None else envs.profile_tokens()
        self._modes = modes if modes is not None else envs.profile_modes()
        self._owner: int | None = None  # the thread that started tracing
        self._done = self.path is None or self.steps < 1
        self._prof: Any = None
        self._range: Any = None
        self._recorded = 0

    @property
    def enabled(self) -> bool:
        """True while this profiler still has steps to record."""
        return not self._done

    def step(self, plan: Any = None) -> None:
        """Mark the start of a step (the first recorded call starts tracing).

        ``plan`` (a ``StepPlan`` or ``MergedPlan``) names the step's range
        with its id, tokens per micro-batch and mode (:func:`step_label`).
        """
        if self._done or _capturing():
            return  # a profiler must not start or stop inside a graph capture
        if self._owner is not None and threading.get_ident() != self._owner:
            return
        if self._skip > 0:
            self._skip -= 1
            return
        if self._prof is None:
            if self._tokens is not None and not _is_step_of(
                plan, self._tokens, self._modes
            ):
                return
            self._owner = threading.get_ident()
            self._start()
        else:
            self._range.__exit__(None, None, None)
            self._recorded += 1
            if self._recorded >= self.steps:
                self._finish()
                return
        self._enter_range(plan)

    def close(self) -> None:
        """Stop and export what was recorded (no-op if nothing or done).

        Only the thread that started tracing can stop it (torch's profiler
        state is per thread; stopping it from another one crashes the
        process). From any other thread this only warns: the trace stays
        open until that thread's next ``step`` or ``close``.
        """
        if self._done or self._prof is None:
            self._done = True
            return
        if threading.get_ident() != self._owner:
            logger.warning(
                "AFD profiler: %d recorded %s steps (rank %d) not written yet: "
                "close() ran on another thread than the steps; the tracing "
                "thread writes them when it closes",
                self._recorded,
                self.role,
                self.rank,
            )
            return
        self._range.__exit__(None, None, None)
        self._recorded += 1
        self._finish()

    def _start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=activities)
        self._prof.__enter__()
        logger.info(
            "AFD profiler: recording %d %s steps (rank %d) to %s",
            self.steps,
            self.role,
            self.rank,
            self.path,
        )

    def _enter_range(self, plan: Any = None) -> None:
        from torch.profiler import record_function

        name = f"afd_{self.role}_step#{self._recorded}"
        if plan is not None:
            name += f" {step_label(plan)}"
        self._range = record_function(name)
        self._range.__enter__()

    def _finish(self) -> None:
        self._done = True
        prof, self._prof, self._range = self._prof, None, None
        prof.__exit__(None, None, None)
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        logger.info(
            "AFD profiler: wrote %d %s steps (rank %d) to %s",
            self._recorded,
            self.role,
            self.rank,
            self.path,
        )
