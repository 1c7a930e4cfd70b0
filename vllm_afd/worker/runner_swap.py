"""Let a native worker build the AFD model runner instead of its own.

The native ``init_device`` constructs its model runner by module-level name
(CPU: ``cpu_worker.CPUModelRunner``; CUDA: the V2 runner
``gpu.model_runner.GPUModelRunner``, imported inside the call);
for the duration of that call the name points at the AFD runner. Everything
else the native ``init_device`` does stays as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from vllm_afd.compat.patching import Patch, scoped_patch

CPU_RUNNER = Patch(
    target="vllm.v1.worker.cpu_worker:CPUModelRunner",
    expected_params=("vllm_config", "device"),
    reason="the CPU worker builds its V1 runner by this name in init_device",
    removal="when vLLM lets a worker subclass choose its model runner class",
)

CUDA_RUNNER = Patch(
    target="vllm.v1.worker.gpu.model_runner:GPUModelRunner",
    expected_params=("vllm_config", "device"),
    reason="the GPU worker imports its V2 runner by this name in init_device "
    "(Worker._make_model_runner)",
    removal="when vLLM lets a worker subclass choose its model runner class",
)


@contextlib.contextmanager
def swapped_runner(patch: Patch, runner_cls: type) -> Iterator[None]:
    """Build ``runner_cls`` wherever the native worker builds ``patch.target``."""
    with scoped_patch(patch, runner_cls):
        yield
