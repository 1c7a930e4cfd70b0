"""CUDA worker selection and the V2 runner swap, against the real vLLM for CUDA.

``EngineArgs.create_engine_config`` with the ``afd`` key picks the AFD CUDA
worker of each role; the V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``) is
refused; the declared runner patch matches the installed vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

# Process-wide state the engine-config hook touches; restored afterwards so the
# servers the other GPU tests start inherit a clean environment.
_ENV_KEYS = ("AFD_SERVER_PID", "PROMETHEUS_MULTIPROC_DIR", "VLLM_USE_V2_MODEL_RUNNER")


@pytest.fixture(autouse=True)
def _registered() -> Iterator[None]:
    import vllm_afd

    env = {key: os.environ.get(key) for key in _ENV_KEYS}
    vllm_afd.register()
    assert vllm_afd.registration_error() is None
    yield
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _config(model: Path, afd: dict[str, Any] | None) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    extra = {} if afd is None else {"additional_config": {"afd": afd}}
    args = EngineArgs(model=str(model), max_model_len=256, enforce_eager=True, **extra)
    return args.create_engine_config()


def test_cuda_without_afd_key_keeps_native_worker_and_v2_runner(
    gpu_tiny_models: dict[str, Path],
) -> None:
    from vllm_afd.compat.workers import CUDA_DEFAULT_WORKER

    config = _config(gpu_tiny_models["deepseek_v2"], None)
    assert config.parallel_config.worker_cls == CUDA_DEFAULT_WORKER
    assert config.use_v2_model_runner


@pytest.mark.parametrize(
    ("role", "worker"),
    [
        ("attention", "vllm_afd.worker.cuda_attention.AFDAttentionWorker"),
        ("ffn", "vllm_afd.worker.cuda_ffn.AFDFFNWorker"),
    ],
)
def test_cuda_auto_worker_maps_to_afd_cuda_worker_of_role(
    gpu_tiny_models: dict[str, Path], role: str, worker: str
) -> None:
    from vllm.utils.import_utils import resolve_obj_by_qualname

    config = _config(gpu_tiny_models["deepseek_v2"], {"role": role})
    assert config.parallel_config.worker_cls == worker
    assert config.use_v2_model_runner
    # The name resolves the way vLLM's worker wrapper will resolve it.
    assert resolve_obj_by_qualname(worker).__qualname__ == worker.rsplit(".", 1)[1]


def test_cuda_v1_runner_is_refused_at_config_time(
    gpu_tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_afd.errors import AFDCompatError

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(AFDCompatError, match="runs the V2 model runner"):
        _config(gpu_tiny_models["deepseek_v2"], {"role": "attention"})


@pytest.mark.parametrize("module", ["cuda_attention", "cuda_ffn"])
def test_cuda_worker_init_device_refuses_v1_runner(module: str) -> None:
    import importlib

    from vllm_afd.errors import AFDCompatError

    mod = importlib.import_module(f"vllm_afd.worker.{module}")
    worker_cls = next(
        getattr(mod, name) for name in dir(mod) if name.endswith("Worker")
    )
    stub = SimpleNamespace(use_v2_model_runner=False)
    with pytest.raises(AFDCompatError, match="VLLM_USE_V2_MODEL_RUNNER"):
        worker_cls.init_device(stub)


def test_cuda_runner_patch_matches_installed_vllm() -> None:
    from vllm.v1.worker.gpu import model_runner

    from vllm_afd.compat.patching import check_patch
    from vllm_afd.worker.cuda_attention import AFDAttentionModelRunner
    from vllm_afd.worker.cuda_ffn import AFDFFNModelRunner
    from vllm_afd.worker.runner_swap import CUDA_RUNNER, swapped_runner

    native = model_runner.GPUModelRunner
    assert check_patch(CUDA_RUNNER) is native
    for runner in (AFDAttentionModelRunner, AFDFFNModelRunner):
        assert issubclass(runner, native)
        with swapped_runner(CUDA_RUNNER, runner):
            assert model_runner.GPUModelRunner is runner
        assert model_runner.GPUModelRunner is native
