"""GPU tests: skipped unless vLLM built for CUDA and enough GPUs are present
(2, or what a test's ``gpus(n)`` marker says; one-GPU tests also start the
MPS daemon, ``mps`` fixture).

Run them with ``tools/gpu/run_gpu_tests.sh OUTDIR`` on a GPU host.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# The end-to-end helpers (real servers, real requests) live beside these tests.
_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent / "e2e")]

MIN_GPUS = 2


@functools.cache
def missing_requirement(min_gpus: int = MIN_GPUS) -> str | None:
    """Why the GPU tests cannot run here, or None when they can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    found = torch.cuda.device_count()
    if found < min_gpus:
        return f"needs {min_gpus} CUDA GPUs, found {found}"
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return "vLLM is not installed"
    if not current_platform.is_cuda():
        return "the installed vLLM is not built for CUDA"
    return None


@pytest.fixture(autouse=True)
def _needs_cuda_vllm(request: pytest.FixtureRequest) -> None:
    marker = request.node.get_closest_marker("gpus")
    reason = missing_requirement(marker.args[0] if marker else MIN_GPUS)
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def _servers_of_this_test() -> Iterator[None]:
    """Every pool server a test asked for is stopped after it (the pool keeps
    none idle here: the next server needs the GPU memory)."""
    import harness

    yield
    harness.POOL.release()
    harness.POOL.trim()


@pytest.fixture(scope="session")
def mps() -> Iterator[None]:
    """An MPS control daemon for this GPU host: both roles on one GPU need it
    (``connector/ipc_layout.check_pair``). Started here, as root, when none
    runs, and stopped again after the session."""
    from vllm_afd.connector.ipc_layout import mps_active

    if mps_active():
        yield
        return
    if shutil.which("nvidia-cuda-mps-control") is None or os.geteuid() != 0:
        pytest.skip("needs the MPS daemon: nvidia-cuda-mps-control -d, as root")
    subprocess.run(["nvidia-cuda-mps-control", "-d"], check=True)
    try:
        deadline = time.monotonic() + 10
        while not mps_active():
            if time.monotonic() > deadline:
                pytest.fail("the MPS control daemon did not come up within 10 s")
            time.sleep(0.1)
        yield
    finally:
        subprocess.run(["nvidia-cuda-mps-control"], input=b"quit\n", check=False)


@pytest.fixture(scope="session")
def gpu_tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny bf16 checkpoints: DeepSeek-V2 and -V3 with the head dims vLLM's
    SM90 MLA needs, Qwen3-MoE and Mixtral."""
    if missing_requirement(1) is not None:
        pytest.skip(missing_requirement(1))
    from vllm_afd.models.tiny_checkpoint import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny-gpu")
    return {
        arch: write_tiny_checkpoint(
            root / arch,
            arch=arch,
            num_layers=4,
            gpu_dims=arch.startswith("deepseek"),
            dtype="bfloat16",
        )
        for arch in ("deepseek_v2", "deepseek_v3", "qwen3_moe", "mixtral")
    }
