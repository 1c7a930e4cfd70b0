"""Worker selection: which worker class each AFD role runs.

vLLM has no worker registry; it imports ``parallel_config.worker_cls`` by
qualified name (vllm/v1/worker/worker_base.py @ 0.32.0). The rules:

1. The engine-config hook records whether the user left ``worker_cls`` as
   ``"auto"`` before vLLM fills in the platform default.
2. Only if it was ``"auto"``, the platform default maps to this role's AFD
   worker (:data:`AFD_WORKERS`).
3. An explicit ``--worker-cls`` is kept, then checked: not this role's AFD
   worker is an error naming both.
4. A platform default not in the table is an error naming it; a field still
   ``"auto"`` at the check means the plugin loaded too late.
5. The model-runner generation must be the one the AFD runner follows on
   that platform: V1 on CPU (V2 needs Triton), V2 on CUDA.
"""

from __future__ import annotations

from vllm_afd.errors import AFDCompatError
from vllm_afd.roles import AFDRole

CPU_DEFAULT_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"
CUDA_DEFAULT_WORKER = "vllm.v1.worker.gpu_worker.Worker"

AFD_CPU_ATTENTION_WORKER = "vllm_afd.worker.cpu_attention.AFDCPUAttentionWorker"
AFD_CPU_FFN_WORKER = "vllm_afd.worker.cpu_ffn.AFDCPUFFNWorker"
AFD_CUDA_ATTENTION_WORKER = "vllm_afd.worker.cuda_attention.AFDAttentionWorker"
AFD_CUDA_FFN_WORKER = "vllm_afd.worker.cuda_ffn.AFDFFNWorker"

#: platform default worker -> {role: AFD worker}
AFD_WORKERS: dict[str, dict[AFDRole, str]] = {
    CPU_DEFAULT_WORKER: {
        AFDRole.ATTENTION: AFD_CPU_ATTENTION_WORKER,
        AFDRole.FFN: AFD_CPU_FFN_WORKER,
    },
    CUDA_DEFAULT_WORKER: {
        AFDRole.ATTENTION: AFD_CUDA_ATTENTION_WORKER,
        AFDRole.FFN: AFD_CUDA_FFN_WORKER,
    },
}

#: platform default worker -> model-runner generation the AFD runner needs
RUNNER_GENERATION: dict[str, str] = {
    CPU_DEFAULT_WORKER: "v1",
    CUDA_DEFAULT_WORKER: "v2",
}


def _qualname(worker_cls: object) -> str:
    if isinstance(worker_cls, str):
        return worker_cls
    if isinstance(worker_cls, type):
        return f"{worker_cls.__module__}.{worker_cls.__qualname__}"
    raise AFDCompatError(
        f"parallel_config.worker_cls must be a class or its qualified name, "
        f"got {type(worker_cls).__name__}"
    )


def afd_worker_for(role: AFDRole, platform_default: str) -> str:
    """Map a platform's default worker to the AFD worker of ``role``.

    Raises:
        AFDCompatError: the platform default is not one AFD knows.
    """
    try:
        return AFD_WORKERS[platform_default][role]
    except KeyError:
        known = ", ".join(sorted(AFD_WORKERS))
        raise AFDCompatError(
            f"AFD has no {role.value} worker for platform default worker "
            f"{platform_default!r}; supported platform defaults: {known}"
        ) from None


def all_afd_workers(role: AFDRole) -> set[str]:
    return {workers[role] for workers in AFD_WORKERS.values()}


def select_worker(
    role: AFDRole, worker_cls: object, *, was_auto: bool, platform_default: str
) -> str:
    """Return the worker class a process of ``role`` must run.

    Args:
        role: the AFD role.
        worker_cls: ``parallel_config.worker_cls`` after vLLM built its config.
        was_auto: whether the user left it as ``"auto"`` (recorded before
            vLLM filled in the platform default).
        platform_default: the platform's default worker qualname.

    Raises:
        AFDCompatError: plugin loaded too late, unknown platform default, or
            an explicit worker that is not this role's AFD worker.
    """
    name = _qualname(worker_cls)
    if name == "auto":
        raise AFDCompatError(
            "parallel_config.worker_cls is still 'auto' after vLLM built its "
            "config: the vllm-afd plugin was loaded too late. Make sure the "
            "'vllm.general_plugins' entry point 'afd' is installed (pip install "
            "vllm-afd) and not excluded by VLLM_PLUGINS"
        )
    if was_auto:
        return afd_worker_for(role, name)
    expected = afd_worker_for(role, platform_default)
    if name != expected:
        raise AFDCompatError(
            f"--worker-cls {name} is not the AFD {role.value} worker; "
            f"afd.role={role.value!r} on this platform needs {expected}. "
            "Drop --worker-cls to let AFD choose it"
        )
    return name


def check_runner_generation(platform_default: str, uses_v2_runner: bool) -> None:
    """Refuse a model-runner generation the AFD runner does not follow.

    Raises:
        AFDCompatError: e.g. V2 on CPU, or V1 (``VLLM_USE_V2_MODEL_RUNNER=0``)
            on CUDA.
    """
    want = RUNNER_GENERATION.get(platform_default)
    got = "v2" if uses_v2_runner else "v1"
    if want is not None and want != got:
        fix = (
            "unset VLLM_USE_V2_MODEL_RUNNER"
            if want == "v2"
            else "set VLLM_USE_V2_MODEL_RUNNER=0"
        )
        raise AFDCompatError(
            f"AFD on {platform_default} runs the {want.upper()} model runner, "
            f"but vLLM selected the {got.upper()} runner; {fix}"
        )
