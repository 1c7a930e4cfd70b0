"""Helpers for GPU end-to-end tests: one set of visible GPUs per role process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness import (
    Completion,
    Deployment,
    plain_outputs,
    run_workload,
    served_model,
    settled_metrics,
)

from vllm_afd.cli.launch import DeploymentSpec

#: settings of every GPU end-to-end server, AFD and baseline alike
GPU_ARGS = [
    "--dtype",
    "bfloat16",
    "--enforce-eager",
    "--gpu-memory-utilization",
    "0.2",
]

#: FULL CUDA graphs for decode steps, no torch.compile
FULL_DECODE_ONLY = [
    "--compilation-config",
    '{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}',
]


def on_devices(process: Any, devices: str, **extra_env: str) -> None:
    """Give one role process (``launch.RoleProcess``) its own visible GPUs
    and extra environment variables (a new dict; the process's is kept)."""
    env = dict(process.env)
    env["CUDA_VISIBLE_DEVICES"] = devices
    env.update(extra_env)
    process.env = env


def nccl_ranks_seen(log_text: str) -> set[int]:
    """Communicator sizes NCCL reported at init (needs ``NCCL_DEBUG=INFO``)."""
    import re

    return {int(n) for n in re.findall(r"nranks (\d+)", log_text, re.IGNORECASE)}


def afd_and_plain(
    spec: DeploymentSpec,
    texts: list[str],
    tmp_path: Path,
    env: dict[str, str] | None = None,
) -> tuple[list[Completion], list[Completion], dict]:
    """The workload's outputs from AFD (attention on GPU 0, FFN on GPU 1) and
    from plain vLLM on GPU 0, each in one server lifetime, and the FFN's
    settled counters. ``env`` goes to every server; logs to ``tmp_path``."""
    env = env or {}
    with (tmp_path / "afd.log").open("w") as log:
        afd = Deployment(spec, log=log)
        on_devices(afd.attention, "0", **env)
        on_devices(afd.ffn, "1", **env)
        try:
            afd.start(ready_timeout=600)
            afd_out = run_workload(afd.api_url, served_model(afd.api_url), texts)
            ffn = settled_metrics(afd.ffn.url)
        finally:
            afd.stop()
    with (tmp_path / "plain.log").open("w") as log:
        plain_out = plain_outputs(spec, texts, log=log, devices="0", env=env)
    return afd_out, plain_out, ffn


def same_count(afd: list[Completion], plain: list[Completion]) -> int:
    """Requests whose token ids are identical."""
    return sum(a.token_ids == p.token_ids for a, p in zip(afd, plain, strict=True))
