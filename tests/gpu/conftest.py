"""GPU tests: skipped unless 2 CUDA GPUs and vLLM built for CUDA are present.

Run them with ``tools/gpu/run_gpu_tests.sh OUTDIR`` on a GPU host.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

# The end-to-end helpers (real servers, real requests) live beside these tests.
_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent / "e2e")]

MIN_GPUS = 2


@functools.cache
def missing_requirement() -> str | None:
    """Why the GPU tests cannot run here, or None when they can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    found = torch.cuda.device_count()
    if found < MIN_GPUS:
        return f"needs {MIN_GPUS} CUDA GPUs, found {found}"
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return "vLLM is not installed"
    if not current_platform.is_cuda():
        return "the installed vLLM is not built for CUDA"
    return None


@pytest.fixture(autouse=True)
def _needs_cuda_vllm() -> None:
    reason = missing_requirement()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def gpu_tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny bf16 DeepSeek-V2 and -V3 with the head dims vLLM's SM90 MLA needs."""
    if missing_requirement() is not None:
        pytest.skip(missing_requirement())
    from vllm_afd.models.tiny_checkpoint import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny-gpu")
    return {
        arch: write_tiny_checkpoint(
            root / arch, arch=arch, num_layers=4, gpu_dims=True, dtype="bfloat16"
        )
        for arch in ("deepseek_v2", "deepseek_v3")
    }
