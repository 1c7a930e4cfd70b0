"""Unit tests for declared patches (vllm_afd.compat.patching).

Drift checks run against the real installed vLLM; the apply/restore mechanics
use throwaway targets defined in this module.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from vllm_afd.compat.patching import (
    PINNED_VLLM_VERSION,
    Patch,
    apply_patch,
    check_patch,
    current_params,
    scoped_patch,
)
from vllm_afd.errors import AFDCompatError

pytest.importorskip("vllm")

THIS_MODULE = sys.modules[__name__]


def _victim(x: int, y: int = 1) -> int:
    return x + y


class _Holder:
    @staticmethod
    def static(a: int) -> int:
        return a

    @classmethod
    def klass(cls, b: int) -> int:
        return b

    def method(self, c: int) -> int:
        return c


def _local(attr: str, params: tuple[str, ...] | None) -> Patch:
    return Patch(
        target=f"{__name__}:{attr}",
        expected_params=params,
        reason="test target",
        removal="never",
    )


VICTIM = _local("_victim", ("x", "y"))
# The module global is what gets patched; keep a reference that is not.
ORIGINAL_VICTIM = _victim


#: family modules of the installed vLLM that need a package the CPU install
#: lacks (Qwen3.5's imports its vision model, which imports torchvision):
#: their patches are checked on the GPU host, where the module imports
NOT_IMPORTABLE_HERE: dict[str, str] = {}


def _importable_here(module: str) -> bool:
    import importlib

    from vllm_afd.models.registry_table import missing_package

    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        lacks = missing_package(e)
        if lacks is None:
            raise  # vLLM itself moved: the drift check below must say so
        NOT_IMPORTABLE_HERE[module] = lacks
        return False
    return True


def _declared_patches() -> list[Patch]:
    from vllm_afd.compat import dp_vote, engine_step, engine_stop
    from vllm_afd.compat.engine_config import CREATE_ENGINE_CONFIG
    from vllm_afd.config import parse_afd_config
    from vllm_afd.models import construction
    from vllm_afd.models.families import FAMILIES
    from vllm_afd.models.ffn_layers import SELECT_EXPERTS, SHARED_LAYER
    from vllm_afd.models.moe_tail import ROUTED_SCALE
    from vllm_afd.serving import ffn_availability
    from vllm_afd.worker.attention_side import GRAPH_CAPTURE, GRAPH_REPLAY
    from vllm_afd.worker.runner_swap import CPU_RUNNER

    family_patches = {
        patch.target: patch
        for family in FAMILIES
        if _importable_here(family.module_path)
        for role in ("attention", "ffn")
        for gate in (False, True)
        for patch, _ in construction.patches_for(
            parse_afd_config({"role": role, "compute_gate_on_attention": gate}),
            family,
            construction.Recorded(),
        )
    }
    return [
        CREATE_ENGINE_CONFIG,
        CPU_RUNNER,
        GRAPH_CAPTURE,
        GRAPH_REPLAY,
        SELECT_EXPERTS,
        SHARED_LAYER,
        ROUTED_SCALE,
        engine_step.STEP,
        engine_step.STEP_WITH_BATCH_QUEUE,
        engine_step.LOG_ERROR_DETAIL,
        engine_stop.SHUTDOWN_TIMEOUT,
        dp_vote.V1_DIST,
        dp_vote.V2_DIST,
        ffn_availability.INIT_MIDDLEWARE,
        *family_patches.values(),
    ]


# -- drift checks against the installed vLLM ------------------------------------


@pytest.mark.parametrize("patch", _declared_patches(), ids=lambda p: p.target)
def test_check_patch_declared_patch_matches_installed_vllm(patch: Patch) -> None:
    assert patch.vllm_version == PINNED_VLLM_VERSION
    original = check_patch(patch)
    assert original is not None
    if patch.expected_params is not None:
        assert current_params(original) == patch.expected_params


def test_only_a_missing_third_party_package_keeps_a_family_out_of_the_check():
    """Every family module this host cannot import misses a package outside
    vLLM (named here), never a vLLM module; on CPU that is Qwen3.5's alone."""
    assert set(NOT_IMPORTABLE_HERE) <= {"vllm.model_executor.models.qwen3_5"}, (
        NOT_IMPORTABLE_HERE
    )


def test_check_patch_wrong_expected_params_raises_drifted_naming_target() -> None:
    from vllm_afd.compat.engine_config import CREATE_ENGINE_CONFIG

    drifted = Patch(
        target=CREATE_ENGINE_CONFIG.target,
        expected_params=("self", "usage_context"),
        reason="a reason the user sees",
        removal="never",
    )
    with pytest.raises(AFDCompatError, match="drifted") as info:
        check_patch(drifted)
    message = str(info.value)
    assert CREATE_ENGINE_CONFIG.target in message
    assert "('self', 'usage_context', 'headless')" in message
    assert PINNED_VLLM_VERSION in message
    assert "a reason the user sees" in message


@pytest.mark.parametrize(
    ("target", "pattern"),
    [
        ("vllm.no_such_module:Thing", r"module vllm\.no_such_module is missing"),
        ("vllm.engine.arg_utils:NoSuchThing", r"'NoSuchThing' not found"),
        ("vllm.engine.arg_utils:NoSuchClass.attr", r"'NoSuchClass' not found"),
        ("vllm.engine.arg_utils:EngineArgs.no_such_method", "'no_such_method' not"),
    ],
)
def test_check_patch_missing_target_raises_naming_it(target: str, pattern: str) -> None:
    patch = Patch(target=target, expected_params=None, reason="r", removal="never")
    with pytest.raises(AFDCompatError, match=pattern) as info:
        check_patch(patch)
    assert f"cannot patch {target}" in str(info.value)


def test_apply_patch_missing_target_raises() -> None:
    patch = Patch(
        target="vllm.no_such_module:Thing",
        expected_params=None,
        reason="r",
        removal="never",
    )
    with pytest.raises(AFDCompatError, match="cannot patch"):
        apply_patch(patch, lambda original: original)


def test_patch_target_splits_into_module_and_attr_path() -> None:
    patch = Patch(target="a.b:C.d", expected_params=None, reason="", removal="")
    assert patch.module_name == "a.b"
    assert patch.attr_path == ("C", "d")


# -- check_patch on the kinds of attribute --------------------------------------


@pytest.mark.parametrize(
    ("attr", "params"),
    [
        ("_Holder.static", ("a",)),
        ("_Holder.klass", ("cls", "b")),
        ("_Holder.method", ("self", "c")),
    ],
)
def test_check_patch_unwraps_static_and_class_methods(
    attr: str, params: tuple[str, ...]
) -> None:
    assert current_params(check_patch(_local(attr, params))) == params


def test_check_patch_none_expected_params_skips_signature_check() -> None:
    assert check_patch(_local("THIS_MODULE", None)) is THIS_MODULE


def test_current_params_returns_none_without_signature() -> None:
    assert current_params(42) is None


# -- apply_patch -------------------------------------------------------------------


def test_apply_patch_replaces_target_and_marks_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(THIS_MODULE, "_victim", ORIGINAL_VICTIM)  # restored at teardown

    def make(original: Any) -> Any:
        def replacement(x: int, y: int = 1) -> int:
            return 10 * original(x, y)

        return replacement

    replacement = apply_patch(VICTIM, make)
    assert THIS_MODULE._victim is replacement
    assert THIS_MODULE._victim(1, 2) == 30
    assert replacement.__afd_patch__ == VICTIM.target
    assert replacement.__afd_original__ is ORIGINAL_VICTIM


def test_apply_patch_twice_is_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(THIS_MODULE, "_victim", ORIGINAL_VICTIM)
    calls = []

    def make(original: Any) -> Any:
        calls.append(original)

        def replacement(x: int, y: int = 1) -> int:
            return -original(x, y)

        return replacement

    first = apply_patch(VICTIM, make)
    second = apply_patch(VICTIM, make)
    assert second is first
    assert calls == [ORIGINAL_VICTIM]
    # Not wrapped twice: one negation, not two.
    assert THIS_MODULE._victim(1, 1) == -2


def test_apply_patch_drifted_target_leaves_it_untouched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(THIS_MODULE, "_victim", ORIGINAL_VICTIM)
    with pytest.raises(AFDCompatError, match="drifted"):
        apply_patch(_local("_victim", ("x",)), lambda original: original)
    assert THIS_MODULE._victim is ORIGINAL_VICTIM


# -- scoped_patch ------------------------------------------------------------------


def test_scoped_patch_swaps_inside_block_and_restores_after() -> None:
    with scoped_patch(VICTIM, abs) as original:
        assert original is ORIGINAL_VICTIM
        assert THIS_MODULE._victim is abs
    assert THIS_MODULE._victim is ORIGINAL_VICTIM


def test_scoped_patch_restores_original_when_body_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"), scoped_patch(VICTIM, abs):
        raise RuntimeError("boom")
    assert THIS_MODULE._victim is ORIGINAL_VICTIM


def test_scoped_patch_restores_staticmethod_descriptor() -> None:
    patch = _local("_Holder.static", ("a",))
    before = _Holder.__dict__["static"]
    with pytest.raises(RuntimeError), scoped_patch(patch, staticmethod(abs)):
        assert _Holder.static(-3) == 3
        raise RuntimeError("boom")
    assert _Holder.__dict__["static"] is before
    assert _Holder.static(-3) == -3


def test_scoped_patch_real_vllm_target_restored_when_body_raises() -> None:
    from vllm.v1.worker import cpu_worker

    from vllm_afd.worker.runner_swap import CPU_RUNNER

    native = cpu_worker.CPUModelRunner

    class Sentinel:
        pass

    with pytest.raises(ValueError, match="inside"), scoped_patch(CPU_RUNNER, Sentinel):
        assert cpu_worker.CPUModelRunner is Sentinel
        raise ValueError("inside")
    assert cpu_worker.CPUModelRunner is native


def test_scoped_patch_drifted_target_raises_before_swapping() -> None:
    with pytest.raises(AFDCompatError, match="drifted"):  # noqa: SIM117
        with scoped_patch(_local("_victim", ("z",)), abs):
            pytest.fail("body must not run")
    assert THIS_MODULE._victim is ORIGINAL_VICTIM
