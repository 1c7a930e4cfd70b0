"""docs/models.md's table of every MoE architecture is the one the code
generates from the installed vLLM's registry, and it names every family
record as served."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_afd.models.families import FAMILIES
from vllm_afd.models.registry_table import moe_architectures, table_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def test_the_docs_table_is_the_generated_one():
    text = DOC.read_text()
    begin, end = "<!-- registry table: begin -->\n", "<!-- registry table: end -->"
    documented = text[text.index(begin) + len(begin) : text.index(end)]
    assert documented == table_markdown(), (
        "docs/models.md is stale: paste `python -m vllm_afd.models.registry_table`"
    )


def test_every_family_record_is_an_moe_architecture_of_the_registry():
    listed = dict(moe_architectures())
    for family in FAMILIES:
        for arch in family.archs:
            assert arch in listed, arch


def test_a_model_package_is_read_whole():
    """vLLM keeps newer models in packages (``vllm.models.deepseek_v4``),
    their MoE layers in submodules: each such MoE architecture is listed."""
    from vllm.model_executor.models import registry

    listed = dict(moe_architectures())
    packaged = {
        arch
        for arch, (module, _) in registry._TEXT_GENERATION_MODELS.items()
        if module.startswith("vllm.models.")
    }
    assert {"DeepseekV4ForCausalLM", "KimiLinearForCausalLM"} <= packaged & set(listed)


def test_a_decoder_layer_holding_its_moe_refuses_the_gate_on_the_ffn_role():
    """Gemma 4 (``layer_holds_moe``): with the gate on the FFN role, the role
    refuses before vLLM builds anything, naming the setting that serves it."""
    from types import SimpleNamespace

    import pytest

    from vllm_afd.errors import AFDConfigError
    from vllm_afd.models.split import role_split_class

    held = [f for f in FAMILIES if f.layer_holds_moe]
    assert [f.name for f in held] == ["gemma4"]
    for role in ("attention", "ffn"):
        afd = {"role": role, **({"rank": 0} if role == "ffn" else {})}
        config = SimpleNamespace(additional_config={"afd": afd})
        with pytest.raises(AFDConfigError, match="set afd.compute_gate_on_attention"):
            role_split_class("Gemma4ForCausalLM")(vllm_config=config)


def test_an_alias_is_split_as_the_architecture_whose_class_vllm_builds():
    """ExaoneMoE and Granite-MoE-SWA are vLLM's aliases, and vLLM builds
    MiMo-V2 with a subclass of MiMo-V2-Flash's that only names its packed
    checkpoint modules: their role-split classes derive from the very class
    of the architecture tested end to end (tests/e2e/test_families.py), or a
    subclass of it, with the same family record."""
    from vllm.model_executor.models.registry import _VLLM_MODELS

    from vllm_afd.models.families import family_of
    from vllm_afd.models.split import role_split_class

    for alias, tested, same_class in [
        ("ExaoneMoEForCausalLM", "ExaoneMoeForCausalLM", True),
        ("GraniteMoeSWAForCausalLM", "GraniteMoeSharedForCausalLM", True),
        ("MiMoV2ForCausalLM", "MiMoV2FlashForCausalLM", False),
    ]:
        assert (_VLLM_MODELS[alias] == _VLLM_MODELS[tested]) is same_class
        assert family_of(alias) is family_of(tested)
        (native,) = role_split_class(tested).__mro__[2:3]
        assert issubclass(role_split_class(alias).__mro__[2], native)
        assert (role_split_class(alias).__mro__[2] is native) is same_class
        assert role_split_class(alias)._afd_arch == alias


def test_the_modules_said_to_need_a_missing_package_fail_to_import_here():
    """Where torchvision is missing (the CPU install), exactly the modules
    ``CPU_IMPORT_NEEDS`` names fail to import, among those of architectures
    with no record and no other reason, each for want of what it names."""
    import importlib.util
    import json
    import subprocess
    import sys

    import pytest

    from vllm_afd.models.families import family_of, vllm_module_path
    from vllm_afd.models.registry_table import CPU_IMPORT_NEEDS, TRIED

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: these modules import here")
    unsure = {
        m.rsplit(".", 1)[-1]: m
        for a, m in moe_architectures()
        if family_of(a) is None and a not in TRIED
    }
    # in a fresh interpreter: what an import fails on depends on what was
    # imported before it (once a served family's module, openPangu's, has
    # imported vLLM's flash-attention utilities, dots3_note fails on a name
    # missing there instead of on the package itself)
    script = (
        "import importlib, json, sys\n"
        "failing = {}\n"
        "for short, path in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        importlib.import_module(path)\n"
        "    except ImportError as e:\n"
        "        failing[short] = str(e)\n"
        "print('FAILING ' + json.dumps(failing))\n"
    )
    modules = [(s, vllm_module_path(m)) for s, m in sorted(unsure.items())]
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(modules)],
        capture_output=True,
        text=True,
        check=True,
    )
    line = next(x for x in done.stdout.splitlines() if x.startswith("FAILING "))
    failing = json.loads(line.removeprefix("FAILING "))
    assert set(failing) == set(CPU_IMPORT_NEEDS)
    for short, message in failing.items():
        assert CPU_IMPORT_NEEDS[short].strip("`") in message, (short, message)


def test_only_a_package_outside_vllm_counts_as_missing_on_this_host():
    from vllm_afd.models.registry_table import missing_package

    assert missing_package(ModuleNotFoundError(name="torchvision")) == "torchvision"
    assert missing_package(ModuleNotFoundError(name="torchvision.ops")) == (
        "torchvision.ops"
    )
    # vLLM itself lacks the module: it moved, which a drift check must report
    assert missing_package(ModuleNotFoundError(name="vllm.models.gone")) is None
    assert missing_package(ModuleNotFoundError()) is None


@pytest.mark.parametrize("arch", ["DbrxForCausalLM", "LlamaForCausalLM"])
def test_a_refused_architecture_is_named_with_what_trying_it_found(arch: str) -> None:
    """The start-up refusal carries the table's reason where the
    architecture was tried (DBRX: plain vLLM's own loader fails on it), and
    only the supported list where it was not (a dense model)."""
    from vllm_afd.compat.engine_config import check_architecture
    from vllm_afd.errors import AFDConfigError
    from vllm_afd.models.registry_table import TRIED

    with pytest.raises(AFDConfigError) as exc:
        check_architecture(arch)
    message = str(exc.value)
    assert f"architecture {arch!r}" in message and "Qwen3MoeForCausalLM" in message
    assert (TRIED.get(arch, "no reason") in message) == (arch in TRIED)
    if arch == "DbrxForCausalLM":
        assert "ffn.experts.routed_experts." in message
