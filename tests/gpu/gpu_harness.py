"""Helpers for GPU end-to-end tests: attention on GPU 0, the FFN on GPU 1,
set through the deployment spec's ``attention_devices`` / ``ffn_devices``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import (
    Completion,
    Deployment,
    LogSink,
    attention_admits_together,
    make_spec,
    one_engine,
    plain_outputs,
    run_workload,
    served_model,
    settled_metrics,
    warm_up,
)

from vllm_afd.deploy import DeploymentSpec

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


#: one GPU per role, unless a test places them otherwise
ROLE_DEVICES = {"attention_devices": "0", "ffn_devices": "1"}


#: both roles on GPU 0 (cuda_ipc data plane, MPS): each with a fixed KV cache,
#: so that neither profiles the memory the other takes. vLLM still checks at
#: start-up that ``--gpu-memory-utilization`` of the GPU is free (0.9 by
#: default): 0.1 lets a server start beside the others of its test and of
#: tests run in parallel (``run_gpu_tests.sh --parallel``); with a KV cache
#: size given, the check is all it changes.
ONE_GPU = {"attention_devices": "0", "ffn_devices": "0"}
ONE_GPU_ARGS = [
    "--dtype",
    "bfloat16",
    "--enforce-eager",
    "--kv-cache-memory-bytes",
    "2000000000",
    "--gpu-memory-utilization",
    "0.1",
]


#: the same with FULL CUDA graphs for decode
ONE_GPU_GRAPHS = [a for a in ONE_GPU_ARGS if a != "--enforce-eager"] + FULL_DECODE_ONLY


def gpu_spec(model: Path, extra: list[str], **kw: Any) -> DeploymentSpec:
    """``harness.make_spec`` with the roles on GPUs 0 and 1 by default, over
    NCCL there (as ``auto`` does; pinned so that the tests stay NCCL's)."""
    kw = {**ROLE_DEVICES, **kw}
    if kw["attention_devices"] != kw["ffn_devices"]:
        kw.setdefault("connector_extra_config", {"backend": "nccl"})
    return make_spec(model, extra, **kw)


def add_env(afd: Deployment, **env: str) -> None:
    """Extra environment variables for every role process (new dicts)."""
    for process in afd.processes:
        process.env = {**process.env, **env}


def nccl_ranks_seen(log_text: str) -> set[int]:
    """Communicator sizes NCCL reported at init (needs ``NCCL_DEBUG=INFO``)."""
    import re

    return {int(n) for n in re.findall(r"nranks (\d+)", log_text, re.IGNORECASE)}


def afd_and_plain(
    spec: DeploymentSpec,
    texts: list[str],
    tmp_path: Path,
    env: dict[str, str] | None = None,
    after: Callable[[Deployment], None] | None = None,
) -> tuple[list[Completion], list[Completion], dict]:
    """The workload's outputs from AFD (on ``spec``'s devices) and from plain
    vLLM on GPU 0, each in one server lifetime after a warm-up run of it
    (``harness.warm_up``), and the FFN's settled
    counters. ``env`` goes to every server; logs to ``tmp_path``. ``after``
    runs on the AFD deployment once its counters are read, before it stops.

    With one attention rank both sides take the measured workload admitted
    together (``harness.run_workload`` with a log): the first step holds
    every request, on AFD as on plain vLLM, so a comparison does not depend
    on how the requests happened to fall into steps (GPU kernels, like CPU
    GEMMs, are picked and round by a step's row count)."""
    env = env or {}
    together = one_engine(spec)
    with (tmp_path / "afd.log").open("w") as log:
        sink = LogSink(tee=log)
        afd = Deployment(spec, log=sink)
        add_env(afd, **env)
        if together:
            attention_admits_together(afd)
        try:
            afd.start(ready_timeout=600)
            warm_up(afd.api_url, texts)
            admitted = sink if together else None
            model = served_model(afd.api_url)
            afd_out = run_workload(afd.api_url, model, texts, log=admitted)
            ffn = settled_metrics(afd.ffn.url)
            if after is not None:
                after(afd)
        finally:
            afd.stop()
    with (tmp_path / "plain.log").open("w") as log:
        plain_out = plain_outputs(
            spec, texts, log=log, devices="0", env=env, warmup=True, together=together
        )
    return afd_out, plain_out, ffn


def same_count(afd: list[Completion], plain: list[Completion]) -> int:
    """Requests whose token ids are identical."""
    return sum(a.token_ids == p.token_ids for a, p in zip(afd, plain, strict=True))
