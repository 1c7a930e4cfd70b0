"""The plugin's ``vllm.general_plugins`` entry point, against the installed vLLM."""

from __future__ import annotations

import os
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm.engine.arg_utils import EngineArgs  # noqa: E402

import vllm_afd  # noqa: E402
from vllm_afd.compat.engine_config import CREATE_ENGINE_CONFIG  # noqa: E402
from vllm_afd.compat.workers import CPU_DEFAULT_WORKER  # noqa: E402
from vllm_afd.models.tiny_checkpoint import write_tiny_checkpoint  # noqa: E402

GROUP = "vllm.general_plugins"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-deepseek-v2")
    return write_tiny_checkpoint(out, arch="deepseek_v2", num_layers=2)


@pytest.fixture
def clean_env() -> Iterator[None]:
    """Undo the environment an AFD config build sets in this process."""
    keys = ("AFD_SERVER_PID", "PROMETHEUS_MULTIPROC_DIR")
    saved = {key: os.environ.get(key) for key in keys}
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _afd_entry_point():
    matches = [ep for ep in entry_points(group=GROUP) if ep.name == "afd"]
    assert len(matches) == 1, matches
    return matches[0]


def test_entry_point_afd_is_discoverable_in_general_plugins_group() -> None:
    ep = _afd_entry_point()
    assert ep.value == "vllm_afd:register"
    assert ep.load() is vllm_afd.register


def test_entry_point_is_loaded_by_vllm_plugin_loader() -> None:
    from vllm.plugins import load_plugins_by_group

    plugins = load_plugins_by_group(group=GROUP)
    assert plugins.get("afd") is vllm_afd.register


def test_register_twice_installs_hook_once() -> None:
    vllm_afd.register()
    first = EngineArgs.create_engine_config
    vllm_afd.register()
    vllm_afd.register()
    hook = EngineArgs.create_engine_config
    assert hook is first
    assert vllm_afd.registration_error() is None
    assert hook.__afd_patch__ == CREATE_ENGINE_CONFIG.target
    # The saved original is vLLM's own method, not an earlier wrapper.
    assert not hasattr(hook.__afd_original__, "__afd_patch__")
    assert hook.__afd_original__.__module__ == "vllm.engine.arg_utils"


def test_register_then_raise_if_registration_failed_is_silent() -> None:
    vllm_afd.register()
    vllm_afd.raise_if_registration_failed()


def test_create_engine_config_non_afd_run_with_plugin_keeps_platform_default(
    checkpoint: Path, clean_env: None
) -> None:
    vllm_afd.register()
    server_pid = os.environ.get("AFD_SERVER_PID")
    args = EngineArgs(
        model=str(checkpoint),
        max_model_len=256,
        enforce_eager=True,
        compilation_config={"custom_ops": ["all", "-rotary_embedding"]},
    )
    config = args.create_engine_config()
    assert EngineArgs.create_engine_config.__afd_patch__ == CREATE_ENGINE_CONFIG.target
    assert config.parallel_config.worker_cls == CPU_DEFAULT_WORKER
    assert config.model_config.model_class_overrides == {}
    assert config.model_config.architectures == ["DeepseekV2ForCausalLM"]
    assert "afd" not in (config.additional_config or {})
    # A non-AFD run leaves no AFD marks on the process environment.
    assert os.environ.get("AFD_SERVER_PID") == server_pid
