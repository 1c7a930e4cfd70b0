"""docs/models.md's table of every MoE architecture is the one the code
generates from the installed vLLM's registry, and it names every family
record as served."""

from __future__ import annotations

from pathlib import Path

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
