"""Helpers for GPU end-to-end tests: one set of visible GPUs per role process."""

from __future__ import annotations

from typing import Any

#: settings of every GPU end-to-end server, AFD and baseline alike
GPU_ARGS = [
    "--dtype",
    "bfloat16",
    "--enforce-eager",
    "--gpu-memory-utilization",
    "0.2",
]


def on_devices(process: Any, devices: str, **extra_env: str) -> None:
    """Give one role process (``launch.RoleProcess``) its own visible GPUs.

    The launcher hands every role the same environment dict; this replaces
    the process's copy instead of editing the shared one.
    """
    env = dict(process.env)
    env["CUDA_VISIBLE_DEVICES"] = devices
    env.update(extra_env)
    process.env = env


def nccl_ranks_seen(log_text: str) -> set[int]:
    """Communicator sizes NCCL reported at init (needs ``NCCL_DEBUG=INFO``)."""
    import re

    return {int(n) for n in re.findall(r"nranks (\d+)", log_text, re.IGNORECASE)}
