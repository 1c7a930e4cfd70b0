"""A running deployment: start every role, wait until healthy, supervise
(restart FFN ranks with a backoff), stop in order.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

from vllm_afd.deploy.commands import memory_budget, role_processes
from vllm_afd.deploy.logs import TextSink
from vllm_afd.deploy.memory import MemoryBudget
from vllm_afd.deploy.process import (
    STARTING_STOP_S,
    WILDCARD_HOSTS,
    DeploymentEnded,
    LaunchError,
    RoleProcess,
    signal_group,
)
from vllm_afd.deploy.spec import DeploymentSpec

#: seconds an FFN rank must run before its restarts in a row count from 0
STABLE_S = 60.0
#: the longest wait before restarting an FFN rank
MAX_BACKOFF_S = 30.0
#: seconds the launcher waits, once an attention process exited, for an FFN
#: rank of its node to say the deployment was stopped (then no failure)
STOP_NOTE_GRACE_S = 5.0
#: seconds the launcher waits, once a role exited while the deployment
#: starts, for the role that failed (an exception in its output) to exit too
CAUSE_GRACE_S = 5.0


class Deployment:
    """A running AFD deployment; use as a context manager.

    ``log`` gets every role's output, each line prefixed ``[role]`` (a
    :class:`~vllm_afd.deploy.logs.ConsoleFilter` shows a short console);
    ``log_dir`` (when given) also keeps each role's full log in
    ``log_dir/ROLE.log``, named in the error when a role exits. ``budget``:
    the roles' memory shares (default :func:`memory_budget`). ``group``:
    before each role's name where it is shown (``prefill-``: the roles of
    an AFD prefill deployment, beside the decode deployment's).
    """

    def __init__(
        self,
        spec: DeploymentSpec,
        log: TextSink | None = sys.stdout,
        log_dir: Path | None = None,
        budget: MemoryBudget | None = None,
        group: str = "",
    ) -> None:
        self.spec = spec
        self.log = log
        self.log_dir = log_dir
        self.budget = memory_budget(spec) if budget is None else budget
        self.processes = role_processes(spec, budget=self.budget)
        for proc in self.processes:
            proc.group = group
            if log_dir is not None:
                proc.log_file = log_dir / f"{proc.label}.log"
        self.ready = False

    @property
    def api_url(self) -> str:
        return self.attention.url

    @property
    def attention(self) -> RoleProcess:
        """The attention server of this node.

        Raises:
            LaunchError: this node runs no attention rank.
        """
        found = next((p for p in self.processes if p.name == "attention"), None)
        if found is None:
            raise LaunchError(f"node {self.spec.node_rank} runs no attention rank")
        return found

    @property
    def ffns(self) -> list[RoleProcess]:
        return [p for p in self.processes if p.name.startswith("ffn")]

    @property
    def ffn(self) -> RoleProcess:
        return self.ffns[0]

    def start(
        self,
        ready_timeout: float = 600.0,
        *,
        attention_first: bool = False,
        stagger_s: float = 0.0,
    ) -> None:
        """Start every role process and wait until all are healthy.

        Roles may start in either order: ``attention_first`` starts the
        attention role ``stagger_s`` seconds before the FFN role.
        """
        self.launch(attention_first=attention_first, stagger_s=stagger_s)
        self.wait_ready(ready_timeout)

    def launch(self, *, attention_first: bool = False, stagger_s: float = 0.0) -> None:
        """Start every role process; :meth:`wait_ready` waits for them."""
        self.ready = False
        order = self.processes[::-1] if attention_first else self.processes
        for i, proc in enumerate(order):
            if i and stagger_s:
                time.sleep(stagger_s)
            proc.start(self.log)

    def healthy(self) -> bool:
        """Every role process answers ``/health`` (raises LaunchError, every
        role stopped, when one exited)."""
        self.check_alive()
        return all(p.healthy() for p in self.processes)

    def wait_ready(self, ready_timeout: float = 600.0) -> None:
        """Wait until every launched role process is healthy.

        Raises:
            LaunchError: one exited, or not all were healthy within
                ``ready_timeout`` s (naming which); every role stopped.
        """
        deadline = time.monotonic() + ready_timeout
        waiting = list(self.processes)
        self.ready = False
        while waiting:
            self.check_alive()
            waiting = [p for p in waiting if not p.healthy()]
            if waiting and time.monotonic() > deadline:
                names = ", ".join(p.label for p in waiting)
                self.stop()
                raise LaunchError(
                    f"timed out after {ready_timeout:.0f}s waiting for {names} to "
                    "become healthy"
                )
            time.sleep(0.5)
        self.ready = True

    def dead(self) -> RoleProcess | None:
        return next((p for p in self.processes if p.exit_code() is not None), None)

    def supervise(self, now: float | None = None) -> None:
        """One round of supervision of a ready deployment (``launch`` calls
        it every second): an FFN rank that exited, or whose ``/health`` has
        not answered for ``spec.ffn_health_timeout_s`` (hung: it is
        SIGKILLed), starts again after a backoff of 1, 2, 4 … 30 s; the
        attention ranks rejoin it by themselves. It gives up after
        ``spec.ffn_restarts`` restarts in a row (a rank that then runs
        :data:`STABLE_S` starts the count again).

        Raises:
            DeploymentEnded: an FFN rank stopped by itself because its
                attention peers shut down for good (the deployment was
                stopped, e.g. from the node of its API server), or says so
                within :data:`STOP_NOTE_GRACE_S` of this node's attention
                process exiting; every role is stopped first.
            LaunchError: an attention process exited, or an FFN rank stopped
                by itself because an attention peer died (an attention rank
                cannot rejoin: the deployment stops), an FFN rank exited with
                restarts off or used up; every role is stopped first.
        """
        now = time.monotonic() if now is None else now
        for proc in self.processes:
            code = proc.exit_code()
            if not proc.is_ffn and code is not None:
                # A node's attention server may exit at about the time its FFN
                # rank says the deployment was stopped; that is no failure.
                self._end_if_stopped(within=STOP_NOTE_GRACE_S, deaths=False)
                self.stop()
                raise LaunchError(
                    f"{proc.exited(code)}; an attention rank cannot rejoin a "
                    "running deployment, so every role stops"
                )
        self._end_if_stopped()
        for proc in self.processes:
            if not proc.is_ffn:
                continue
            if proc.restart_at is not None:
                if now >= proc.restart_at:
                    proc.restart_at = None
                    self._say(f"starting {proc.label} again (restart {proc.restarts})")
                    proc.start(self.log)
                continue
            code = proc.exit_code()
            if code is None and not proc.headless:
                code = self._probe(proc, now)
            if code is None:
                continue
            self._end_if_stopped()  # its word may have come as it exited
            if now - proc.started_at >= STABLE_S:
                proc.restarts = 0
            if proc.restarts >= self.spec.ffn_restarts:
                self.stop()
                why = (
                    "restarts are off (--ffn-restarts 0)"
                    if self.spec.ffn_restarts == 0
                    else f"it failed {proc.restarts} restarts in a row"
                )
                raise LaunchError(f"{proc.exited(code)}; {why}")
            proc.restarts += 1
            delay = min(2.0 ** (proc.restarts - 1), MAX_BACKOFF_S)
            proc.restart_at = now + delay
            self._say(
                f"{proc.label} exited with code {code}; restarting it in "
                f"{delay:.0f}s (restart {proc.restarts} of at most "
                f"{self.spec.ffn_restarts} in a row)"
            )

    def _end_if_stopped(self, within: float = 0.0, *, deaths: bool = True) -> None:
        """Raise :class:`DeploymentEnded` (every role stopped first) if an
        FFN rank of this node says it stopped for good, :class:`LaunchError`
        if one says an attention peer died (unless not ``deaths``: the caller
        has a better word for it); wait up to ``within`` s for one to say
        either, unless every FFN rank of the node has exited."""
        deadline = time.monotonic() + within
        while True:
            for proc in self.ffns:
                if (why := proc.stopped_for_good()) is not None:
                    self.stop()
                    raise DeploymentEnded(
                        f"{proc.label} stopped by itself ({why}: the deployment "
                        "was stopped); every role of this node stops"
                    )
                if (why := proc.peer_died()) is not None:
                    if not deaths:
                        return
                    self.stop()
                    raise LaunchError(
                        f"{proc.label} stopped by itself: {why}; an attention rank "
                        "cannot rejoin a running deployment, so every role of "
                        "this node stops"
                    )
            done = all(p.exit_code() is not None for p in self.ffns)
            if done or time.monotonic() >= deadline:
                return
            time.sleep(0.1)

    def _probe(self, proc: RoleProcess, now: float) -> int | None:
        """None while ``proc`` is fine; else what to report as its exit code
        after killing it (it was healthy, and has not answered /health for
        ``ffn_health_timeout_s``, or never answered within ``ready_timeout``)."""
        if proc.healthy():
            proc.healthy_since_start, proc.last_healthy = True, now
            return None
        if proc.healthy_since_start:
            silent = now - proc.last_healthy
            if silent < self.spec.ffn_health_timeout_s:
                return None
            why = f"has not answered /health for {silent:.0f}s (hung)"
        elif now - proc.started_at < self.spec.ready_timeout_s:
            return None
        else:
            why = f"did not become healthy within {self.spec.ready_timeout_s:.0f}s"
        self._say(f"{proc.label} {why}; killing it")
        if proc.proc is not None:
            signal_group(proc.proc, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.proc.wait(10)
        return proc.exit_code()

    def _say(self, line: str) -> None:
        print(f"vllm-afd launch: {line}", file=sys.stderr, flush=True)

    def check_alive(self) -> None:
        """Raise if a role process has exited (every role stopped first).

        A role that fails takes its peers down with it (an FFN rank stops by
        itself when its attention peer is gone), and they may exit first:
        the error names the role that failed, the first whose output has an
        exception line (waiting up to :data:`CAUSE_GRACE_S` for it).

        Raises:
            LaunchError: ``the NAME process exited with code N: CAUSE (full
                log: PATH)``.
        """
        dead = self.dead()
        if dead is None:
            return
        deadline = time.monotonic() + CAUSE_GRACE_S
        while True:
            gone = [p for p in self.processes if p.exit_code() is not None]
            failed = [p for p in gone if p.first_error or p.exit_code() != 0]
            if failed or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        culprit = next((p for p in failed if p.first_error), None)
        culprit = culprit or (failed[0] if failed else dead)
        code = culprit.exit_code()
        self.stop()
        raise LaunchError(culprit.exited(code))

    def stop(self, timeout: float = 30.0) -> None:
        """Stop every role. A ready deployment stops attention first (its
        shutdown tells the FFN ranks to stop), each role within ``timeout``
        s; one still starting stops all roles at once, within
        :data:`STARTING_STOP_S`."""
        if not self.ready:
            for proc in self.processes:
                proc.request_stop()
            deadline = time.monotonic() + min(timeout, STARTING_STOP_S)
            for proc in self.processes:
                proc.finish_stop(deadline)
        else:
            for proc in reversed(self.processes):
                proc.stop(timeout)
        for proc in self.processes:
            proc.forget_stop_note()

    def __enter__(self) -> Deployment:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def ready_line(deployment: Deployment) -> str:
    """The line ``launch`` prints once every role is healthy: the URL a
    client on this machine uses, and the bind address when it is every
    interface."""
    spec = deployment.spec
    name = f"AFD {spec.attention_ranks}A{spec.ffn_ranks}F"
    api = next(
        (p for p in deployment.processes if p.name == "attention" and not p.headless),
        None,
    )
    where = ""
    if spec.multi_host:
        where = f" (node {spec.node_rank} of {len(spec.hosts or ())})"
    if api is None:
        names = ", ".join(
            f"{p.name} (headless)" if p.headless else f"{p.name} ({p.url})"
            for p in deployment.processes
        )
        return f"{name} ready on node {spec.node_rank}: {names}{where}"
    line = f"{name} ready: {api.url}/v1{where}"
    if api.host in WILDCARD_HOSTS:
        line += f" (the API listens on all interfaces, {api.host or '0.0.0.0'})"
    return line
