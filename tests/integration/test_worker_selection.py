"""Worker selection through the real ``EngineArgs.create_engine_config`` (CPU).

Drives the installed vLLM's config builder with the plugin's engine-config hook
in place, on a tiny local DeepSeek-V2 checkpoint. The selection rules that need
another platform (CUDA, an unknown default, a late plugin) are exercised on
:mod:`vllm_afd.compat.workers` directly.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.engine.arg_utils import EngineArgs  # noqa: E402

import vllm_afd  # noqa: E402
from vllm_afd.compat.engine_config import afd_model_classes  # noqa: E402
from vllm_afd.compat.workers import (  # noqa: E402
    AFD_CPU_ATTENTION_WORKER,
    AFD_CPU_FFN_WORKER,
    AFD_CUDA_ATTENTION_WORKER,
    AFD_CUDA_FFN_WORKER,
    CPU_DEFAULT_WORKER,
    CUDA_DEFAULT_WORKER,
    afd_worker_for,
    all_afd_workers,
    check_runner_generation,
    select_worker,
)
from vllm_afd.config import AFDRole  # noqa: E402
from vllm_afd.errors import AFDCompatError, AFDConfigError  # noqa: E402
from vllm_afd.models.tiny_checkpoint import write_tiny_checkpoint  # noqa: E402

# Process-wide state the AFD engine-config hook touches (as a server's front end
# would); restored after this module so other tests see a clean process.
_ENV_KEYS = ("AFD_SERVER_PID", "PROMETHEUS_MULTIPROC_DIR")


@pytest.fixture(scope="module", autouse=True)
def _plugin_registered() -> Iterator[None]:
    from prometheus_client import values
    from vllm.config import model as model_config
    from vllm.model_executor.models.registry import ModelRegistry

    env = {key: os.environ.get(key) for key in _ENV_KEYS}
    value_class = values.ValueClass
    models = dict(ModelRegistry.models)
    overrides = set(model_config._REGISTERED_MODEL_CLASS_OVERRIDES)

    vllm_afd.register()
    assert vllm_afd.registration_error() is None
    yield

    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    values.ValueClass = value_class
    ModelRegistry.models.clear()
    ModelRegistry.models.update(models)
    model_config._REGISTERED_MODEL_CLASS_OVERRIDES.clear()
    model_config._REGISTERED_MODEL_CLASS_OVERRIDES.update(overrides)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-deepseek-v2")
    return write_tiny_checkpoint(out, arch="deepseek_v2", num_layers=2)


def _engine_args(checkpoint: Path, afd: Any = None, **kwargs: Any) -> EngineArgs:
    if afd is not None:
        kwargs["additional_config"] = {"afd": afd}
    return EngineArgs(
        model=str(checkpoint),
        max_model_len=256,
        enforce_eager=True,
        compilation_config={"custom_ops": ["all", "-rotary_embedding"]},
        **kwargs,
    )


# -- through create_engine_config ----------------------------------------------


def test_create_engine_config_without_afd_key_keeps_cpu_default_worker(
    checkpoint: Path,
) -> None:
    args = _engine_args(checkpoint)
    config = args.create_engine_config()
    assert config.parallel_config.worker_cls == CPU_DEFAULT_WORKER
    assert config.model_config.model_class_overrides == {}
    assert args.model_class_overrides == {}
    assert "afd" not in config.additional_config


def test_create_engine_config_without_afd_key_keeps_user_model_overrides(
    checkpoint: Path,
) -> None:
    user = {"SomeOtherForCausalLM": "some.module:SomeOther"}
    config = _engine_args(checkpoint, model_class_overrides=dict(user))
    config = config.create_engine_config()
    assert config.model_config.model_class_overrides == user
    assert config.parallel_config.worker_cls == CPU_DEFAULT_WORKER


def test_ffn_role_on_cpu_reserves_no_kv_cache_memory(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's CPU worker asks --gpu-memory-utilization of the RAM to be free
    for the KV cache unless a KV cache size is set; the FFN role has none."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    ffn = _engine_args(checkpoint, {"role": "ffn"}).create_engine_config()
    assert ffn.cache_config.kv_cache_memory_bytes == 0
    attention = _engine_args(checkpoint, {"role": "attention"}).create_engine_config()
    assert attention.cache_config.kv_cache_memory_bytes is None  # vLLM's default
    mine = _engine_args(checkpoint, {"role": "ffn"}, kv_cache_memory_bytes=1 << 20)
    assert mine.create_engine_config().cache_config.kv_cache_memory_bytes == 1 << 20


def test_ffn_role_refuses_a_kv_connector_the_attention_role_takes(
    checkpoint: Path, tmp_path: Path
) -> None:
    from vllm.config import KVTransferConfig

    kv = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
    }
    with pytest.raises(AFDConfigError, match="FFN role holds no KV cache"):
        _engine_args(
            checkpoint, {"role": "ffn"}, kv_transfer_config=KVTransferConfig(**kv)
        ).create_engine_config()
    attention = _engine_args(
        checkpoint, {"role": "attention"}, kv_transfer_config=KVTransferConfig(**kv)
    ).create_engine_config()
    assert attention.kv_transfer_config.kv_connector == "ExampleConnector"


@pytest.mark.parametrize(
    ("role", "worker"),
    [("attention", AFD_CPU_ATTENTION_WORKER), ("ffn", AFD_CPU_FFN_WORKER)],
)
def test_create_engine_config_auto_worker_maps_to_afd_cpu_worker_of_role(
    checkpoint: Path, role: str, worker: str
) -> None:
    config = _engine_args(checkpoint, {"role": role}).create_engine_config()
    assert config.parallel_config.worker_cls == worker
    # registered the plugin way, not through the development-only overrides
    assert config.model_config.model_class_overrides == {}
    assert _registered_afd_classes() == afd_model_classes()
    # The normalised afd config travels to the workers as plain values.
    afd = config.additional_config["afd"]
    assert type(afd) is dict
    assert afd["role"] == role
    assert afd["connector"] == "p2p"
    assert type(afd["connector_extra_config"]) is dict


def test_create_engine_config_afd_merges_user_model_overrides(
    checkpoint: Path,
) -> None:
    user = {"SomeOtherForCausalLM": "some.module:SomeOther"}
    args = _engine_args(
        checkpoint, {"role": "attention"}, model_class_overrides=dict(user)
    )
    config = args.create_engine_config()
    assert config.model_config.model_class_overrides == user
    assert _registered_afd_classes() == afd_model_classes()


def _registered_afd_classes() -> dict[str, str]:
    """Architecture -> ``module:Class`` of vLLM's registry entries that name
    an AFD class."""
    from vllm import ModelRegistry

    found = {}
    for arch, entry in ModelRegistry.models.items():
        module = getattr(entry, "module_name", "")
        if module.startswith("vllm_afd."):
            found[arch] = f"{module}:{entry.class_name}"
    return found


@pytest.mark.parametrize(
    ("role", "worker"),
    [("attention", AFD_CPU_ATTENTION_WORKER), ("ffn", AFD_CPU_FFN_WORKER)],
)
def test_create_engine_config_explicit_afd_worker_of_role_is_kept(
    checkpoint: Path, role: str, worker: str
) -> None:
    args = _engine_args(checkpoint, {"role": role}, worker_cls=worker)
    assert args.create_engine_config().parallel_config.worker_cls == worker


@pytest.mark.parametrize(
    ("role", "explicit", "expected"),
    [
        ("ffn", CPU_DEFAULT_WORKER, AFD_CPU_FFN_WORKER),
        ("ffn", AFD_CPU_ATTENTION_WORKER, AFD_CPU_FFN_WORKER),
        ("attention", AFD_CPU_FFN_WORKER, AFD_CPU_ATTENTION_WORKER),
    ],
)
def test_create_engine_config_explicit_wrong_worker_raises_naming_both(
    checkpoint: Path, role: str, explicit: str, expected: str
) -> None:
    args = _engine_args(checkpoint, {"role": role}, worker_cls=explicit)
    with pytest.raises(AFDCompatError) as info:
        args.create_engine_config()
    message = str(info.value)
    assert f"--worker-cls {explicit} is not the AFD {role} worker" in message
    assert f"needs {expected}" in message
    assert "Drop --worker-cls" in message


@pytest.mark.parametrize(
    ("afd", "pattern"),
    [
        ({"role": "decoder"}, "afd.role='decoder' is not a role"),
        (
            {"role": "ffn", "num_atention_ranks": 2},
            "did you mean 'num_attention_ranks'",
        ),
        ("attention", r'additional_config\["afd"\] must be a JSON object'),
        ({"role": "ffn", "connector": "nope"}, "not a registered connector"),
    ],
)
def test_create_engine_config_bad_afd_config_raises_config_error(
    checkpoint: Path, afd: Any, pattern: str
) -> None:
    with pytest.raises(AFDConfigError, match=pattern):
        _engine_args(checkpoint, afd).create_engine_config()


def test_create_engine_config_attention_dp_size_mismatch_raises_config_error(
    checkpoint: Path,
) -> None:
    afd = {"role": "attention", "num_attention_ranks": 2}
    with pytest.raises(AFDConfigError) as info:
        _engine_args(checkpoint, afd, data_parallel_size=1).create_engine_config()
    message = str(info.value)
    assert "afd.num_attention_ranks=2" in message
    assert "data_parallel_size=1" in message
    assert "--data-parallel-size 2" in message


def test_create_engine_config_data_parallel_ffn_role_raises_config_error(
    checkpoint: Path,
) -> None:
    afd = {"role": "ffn", "num_attention_ranks": 4, "num_ffn_ranks": 2, "rank": 1}
    with pytest.raises(AFDConfigError, match=r"one vllm serve per FFN rank") as info:
        _engine_args(checkpoint, afd, data_parallel_size=2).create_engine_config()
    assert "data_parallel_size=2" in str(info.value)


def test_create_engine_config_ffn_rank_selects_ffn_worker(checkpoint: Path) -> None:
    afd = {"role": "ffn", "num_attention_ranks": 4, "num_ffn_ranks": 2, "rank": 1}
    config = _engine_args(checkpoint, afd).create_engine_config()
    assert config.parallel_config.worker_cls == AFD_CPU_FFN_WORKER
    assert config.additional_config["afd"]["rank"] == 1


def test_create_engine_config_stored_registration_error_raises_for_afd_only(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cause = ImportError("simulated missing dependency")
    monkeypatch.setattr(vllm_afd, "_registration_error", cause)

    with pytest.raises(AFDCompatError, match="failed to register") as info:
        _engine_args(checkpoint, {"role": "attention"}).create_engine_config()
    assert info.value.__cause__ is cause

    # A run without the afd key is not affected by the stored failure.
    config = _engine_args(checkpoint).create_engine_config()
    assert config.parallel_config.worker_cls == CPU_DEFAULT_WORKER


# -- the worker classes named by the table --------------------------------------


@pytest.mark.parametrize("qualname", [AFD_CPU_ATTENTION_WORKER, AFD_CPU_FFN_WORKER])
def test_afd_cpu_worker_qualname_resolves_to_cpu_worker_subclass(
    qualname: str,
) -> None:
    from vllm.v1.worker.cpu_worker import CPUWorker

    module_name, _, cls_name = qualname.rpartition(".")
    cls = getattr(importlib.import_module(module_name), cls_name)
    assert issubclass(cls, CPUWorker)


# -- selection rules on other platforms (pure functions) ---------------------------


@pytest.mark.parametrize(
    ("default", "role", "worker"),
    [
        (CPU_DEFAULT_WORKER, AFDRole.ATTENTION, AFD_CPU_ATTENTION_WORKER),
        (CPU_DEFAULT_WORKER, AFDRole.FFN, AFD_CPU_FFN_WORKER),
        (CUDA_DEFAULT_WORKER, AFDRole.ATTENTION, AFD_CUDA_ATTENTION_WORKER),
        (CUDA_DEFAULT_WORKER, AFDRole.FFN, AFD_CUDA_FFN_WORKER),
    ],
)
def test_select_worker_auto_maps_platform_default_to_role_worker(
    default: str, role: AFDRole, worker: str
) -> None:
    assert afd_worker_for(role, default) == worker
    got = select_worker(role, default, was_auto=True, platform_default=default)
    assert got == worker
    # The explicit AFD worker of the role is kept as is.
    assert select_worker(role, worker, was_auto=False, platform_default=default) == (
        worker
    )


def test_select_worker_explicit_cuda_worker_of_other_role_raises() -> None:
    with pytest.raises(AFDCompatError) as info:
        select_worker(
            AFDRole.ATTENTION,
            AFD_CUDA_FFN_WORKER,
            was_auto=False,
            platform_default=CUDA_DEFAULT_WORKER,
        )
    assert AFD_CUDA_FFN_WORKER in str(info.value)
    assert AFD_CUDA_ATTENTION_WORKER in str(info.value)


def test_select_worker_explicit_cpu_worker_on_cuda_platform_raises() -> None:
    with pytest.raises(AFDCompatError, match="is not the AFD ffn worker"):
        select_worker(
            AFDRole.FFN,
            AFD_CPU_FFN_WORKER,
            was_auto=False,
            platform_default=CUDA_DEFAULT_WORKER,
        )


def test_select_worker_accepts_worker_class_object() -> None:
    from vllm.v1.worker.cpu_worker import CPUWorker

    got = select_worker(
        AFDRole.FFN, CPUWorker, was_auto=True, platform_default=CPU_DEFAULT_WORKER
    )
    assert got == AFD_CPU_FFN_WORKER


def test_select_worker_rejects_worker_cls_of_wrong_type() -> None:
    with pytest.raises(AFDCompatError, match="got int"):
        select_worker(
            AFDRole.FFN, 3, was_auto=True, platform_default=CPU_DEFAULT_WORKER
        )


FAKE_DEFAULT = "vllm.v1.worker.fake_worker.FakeAcceleratorWorker"


@pytest.mark.parametrize("role", list(AFDRole))
def test_afd_worker_for_unknown_platform_default_raises_naming_it(
    role: AFDRole,
) -> None:
    with pytest.raises(AFDCompatError) as info:
        afd_worker_for(role, FAKE_DEFAULT)
    message = str(info.value)
    assert f"AFD has no {role.value} worker" in message
    assert repr(FAKE_DEFAULT) in message
    assert CPU_DEFAULT_WORKER in message and CUDA_DEFAULT_WORKER in message


@pytest.mark.parametrize("was_auto", [True, False])
def test_select_worker_unknown_platform_default_raises_naming_it(
    was_auto: bool,
) -> None:
    worker = FAKE_DEFAULT if was_auto else "my.pkg.MyWorker"
    with pytest.raises(AFDCompatError, match=FAKE_DEFAULT.replace(".", r"\.")):
        select_worker(
            AFDRole.ATTENTION, worker, was_auto=was_auto, platform_default=FAKE_DEFAULT
        )


@pytest.mark.parametrize("was_auto", [True, False])
def test_select_worker_still_auto_raises_plugin_loaded_too_late(
    was_auto: bool,
) -> None:
    with pytest.raises(AFDCompatError) as info:
        select_worker(
            AFDRole.FFN,
            "auto",
            was_auto=was_auto,
            platform_default=CPU_DEFAULT_WORKER,
        )
    message = str(info.value)
    assert "still 'auto'" in message
    assert "loaded too late" in message
    assert "vllm.general_plugins" in message and "VLLM_PLUGINS" in message


def test_all_afd_workers_lists_each_platform_worker_of_role() -> None:
    assert all_afd_workers(AFDRole.ATTENTION) == {
        AFD_CPU_ATTENTION_WORKER,
        AFD_CUDA_ATTENTION_WORKER,
    }
    assert all_afd_workers(AFDRole.FFN) == {AFD_CPU_FFN_WORKER, AFD_CUDA_FFN_WORKER}


@pytest.mark.parametrize(
    ("default", "uses_v2"),
    [(CPU_DEFAULT_WORKER, False), (CUDA_DEFAULT_WORKER, True), (FAKE_DEFAULT, True)],
)
def test_check_runner_generation_supported_generation_passes(
    default: str, uses_v2: bool
) -> None:
    check_runner_generation(default, uses_v2_runner=uses_v2)


def test_check_runner_generation_v2_on_cpu_raises() -> None:
    with pytest.raises(AFDCompatError) as info:
        check_runner_generation(CPU_DEFAULT_WORKER, uses_v2_runner=True)
    message = str(info.value)
    assert "runs the V1 model runner" in message
    assert "selected the V2 runner" in message
    assert "set VLLM_USE_V2_MODEL_RUNNER=0" in message


def test_check_runner_generation_v1_on_cuda_raises() -> None:
    with pytest.raises(AFDCompatError) as info:
        check_runner_generation(CUDA_DEFAULT_WORKER, uses_v2_runner=False)
    message = str(info.value)
    assert CUDA_DEFAULT_WORKER in message
    assert "runs the V2 model runner" in message
    assert "unset VLLM_USE_V2_MODEL_RUNNER" in message


@pytest.mark.parametrize(
    "mode,breakable,refused",
    [
        ("FULL_AND_PIECEWISE", True, True),
        ("PIECEWISE", True, True),
        ("FULL_DECODE_ONLY", True, False),
        ("FULL_AND_PIECEWISE", False, False),
    ],
)
def test_attention_refuses_breakable_piecewise_graphs(
    mode: str, breakable: bool, refused: bool
) -> None:
    """A breakable graph replays the forward without running it, so the plan
    of a step would never be sent; compiled piecewise graphs run it."""
    from vllm.config import CompilationConfig, CUDAGraphMode

    from vllm_afd.compat.engine_config import check_graph_mode

    compilation = CompilationConfig(cudagraph_mode=CUDAGraphMode[mode])
    if not refused:
        check_graph_mode(compilation, breakable)
        return
    with pytest.raises(AFDConfigError) as info:
        check_graph_mode(compilation, breakable)
    message = str(info.value)
    assert f"VLLM_USE_BREAKABLE_CUDAGRAPH=1 with cudagraph_mode {mode}" in message
    assert "VLLM_USE_BREAKABLE_CUDAGRAPH=0" in message
    assert "FULL_DECODE_ONLY" in message and "--enforce-eager" in message


def test_create_engine_config_p2p_ubatches_on_cpu_raise_config_error(
    checkpoint: Path,
) -> None:
    afd = {"role": "attention", "num_ubatches": 2}
    with pytest.raises(
        AFDConfigError,
        match=r"afd.num_ubatches=2 with the p2p connector needs CUDA .* or the "
        r"async connector",
    ):
        _engine_args(checkpoint, afd).create_engine_config()
    # async splits steps into request-boundary stages on CPU
    staged = {"role": "attention", "connector": "async", "num_ubatches": 2}
    config = _engine_args(checkpoint, staged).create_engine_config()
    assert not config.parallel_config.use_ubatching  # vLLM's own DBO stays off
    # The FFN role follows the step plans: the key is accepted and unused.
    ffn = _engine_args(checkpoint, {"role": "ffn", "num_ubatches": 2})
    assert ffn.create_engine_config().parallel_config.worker_cls == AFD_CPU_FFN_WORKER


def test_create_engine_config_shared_devices_on_cpu_raise_config_error(
    checkpoint: Path,
) -> None:
    afd = {
        "role": "attention",
        "num_attention_ranks": 2,
        "attention_ranks_per_device": 2,
    }
    with pytest.raises(
        AFDConfigError, match=r"afd.attention_ranks_per_device=2 places attention ranks"
    ):
        _engine_args(checkpoint, afd, data_parallel_size=2).create_engine_config()
