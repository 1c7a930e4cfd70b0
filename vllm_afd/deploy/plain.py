"""Plain vLLM (no AFD) on a deployment's model and settings: the baseline
of every comparison.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from vllm_afd.deploy.commands import (
    CPU_COMPILATION_CONFIG,
    api_host_of,
    child_env,
    on_cpu,
    serve_argv,
    wants_cpu_workaround,
)
from vllm_afd.deploy.logs import TextSink
from vllm_afd.deploy.process import LaunchError, RoleProcess
from vllm_afd.deploy.spec import DeploymentSpec


class PlainServer:
    """Plain vLLM (no AFD) on the spec's model and settings: the baseline."""

    def __init__(
        self,
        spec: DeploymentSpec,
        log: TextSink | None = sys.stdout,
        port: int | None = None,
        name: str = "plain",
        log_dir: Path | None = None,
    ) -> None:
        common = list(spec.vllm_args)
        if wants_cpu_workaround(spec):
            common += ["--compilation-config", CPU_COMPILATION_CONFIG]
        host = api_host_of(spec, [])
        self.process = RoleProcess(
            name,
            serve_argv(spec.model, port or spec.port, common, host),
            port or spec.port,
            child_env(spec.plain_devices(), on_cpu(spec)),
            host,
        )
        if log_dir is not None:
            self.process.log_file = log_dir / f"{name}.log"
        self.log = log

    @property
    def url(self) -> str:
        return self.process.url

    def start(self, ready_timeout: float = 600.0) -> None:
        self.begin()
        self.wait_ready(ready_timeout)

    def begin(self) -> None:
        """Start the server without waiting for it (:meth:`wait_ready`)."""
        self.process.start(self.log)

    def wait_ready(self, ready_timeout: float = 600.0) -> None:
        """Wait until the server begun answers ``/health``.

        Raises:
            LaunchError: it exited (naming its cause), or was not healthy
                within ``ready_timeout`` seconds (then it is stopped).
        """
        deadline = time.monotonic() + ready_timeout
        while not self.process.healthy():
            code = self.process.exit_code()
            if code is not None:
                raise LaunchError(self.process.exited(code))
            if time.monotonic() > deadline:
                self.stop()
                raise LaunchError("timed out waiting for plain vLLM to become healthy")
            time.sleep(0.5)

    def stop(self, timeout: float = 30.0) -> None:
        self.process.stop(timeout)

    def __enter__(self) -> PlainServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
