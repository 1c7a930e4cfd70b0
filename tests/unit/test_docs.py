"""The docs match the code: links resolve, and every config key, connector
option, CLI flag and counter a user can meet is documented."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
import unicodedata
from pathlib import Path

import pytest

from vllm_afd.cli.main import build_parser
from vllm_afd.config import AFDConfig
from vllm_afd.connector.factory import _SPECS
from vllm_afd.worker.metrics import METRICS

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped,
    spaces to hyphens."""
    text = heading.strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m) for m in re.findall(r"^#+ (.+)$", text, re.M)}


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


def test_slug_matches_github() -> None:
    assert slug("Measured (2× H200, vLLM 0.32.0, torch 2.11 + CUDA 13.0)") == (
        "measured-2-h200-vllm-0320-torch-211--cuda-130"
    )
    assert slug("Supported / not yet") == "supported--not-yet"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_every_config_key_is_documented() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    keys = [f.name for f in dataclasses.fields(AFDConfig)]
    missing = [k for k in keys if f"| `{k}` |" not in text]
    assert not missing, f"afd keys missing from docs/configuration.md: {missing}"


def test_every_connector_and_option_is_documented() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text() + (
        ROOT / "docs" / "connector.md"
    ).read_text()
    missing = [
        name
        for spec in _SPECS
        for name in (spec.name, *spec.aliases, *spec.options)
        if f"`{name}`" not in text
    ]
    assert not missing, f"connectors/options missing from the docs: {missing}"


def _flags(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {
        name: [
            s
            for a in p._actions
            for s in a.option_strings
            if s.startswith("--") and s != "--help"
        ]
        for name, p in sub.choices.items()
    }


def test_every_cli_flag_is_documented() -> None:
    docs = {p.name: p.read_text() for p in (ROOT / "docs").glob("*.md")}
    text = "\n".join(docs.values())
    missing = [
        f"{command} {flag}"
        for command, flags in _flags(build_parser()).items()
        for flag in flags
        if f"`{flag}`" not in text and f"`{flag} " not in text
    ]
    assert not missing, f"CLI flags missing from docs/: {missing}"


def test_every_counter_is_documented() -> None:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    missing = [
        f"{name}_total" for name, _ in METRICS.values() if f"{name}_total" not in text
    ]
    assert not missing, f"counters missing from docs/benchmarks.md: {missing}"


def _raised_messages() -> list[tuple[str, str]]:
    """(where, longest literal piece) of every ``raise AFD...Error(msg)``."""

    def pieces(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, ast.JoinedStr):
            return [v.value for v in node.values if isinstance(v, ast.Constant)]
        if isinstance(node, ast.BinOp):
            return pieces(node.left) + pieces(node.right)
        return []

    found = []
    for path in sorted((ROOT / "vllm_afd").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Raise)
                and isinstance(node.exc, ast.Call)
                and getattr(node.exc.func, "id", "").startswith("AFD")
                and node.exc.args
            ):
                continue
            texts = [
                " ".join(p.split()).strip(" :;,.'\"") for p in pieces(node.exc.args[0])
            ]
            texts = [t for t in texts if len(t) >= 12]
            if texts:
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                found.append((where, max(texts, key=len)))
    return found


def test_every_error_message_is_documented() -> None:
    """The longest fixed piece of every AFD error the code raises appears in
    README.md or docs/ (whitespace aside), so a user who meets it finds it."""
    text = " ".join(" ".join(p.read_text() for p in PAGES).split())
    messages = _raised_messages()
    assert len(messages) > 50  # the extraction works
    missing = [f"{where}: {piece!r}" for where, piece in messages if piece not in text]
    assert not missing, "errors missing from the docs:\n" + "\n".join(missing)


def _arch_row(page: str, start: str) -> set[str]:
    """The backticked names in the table row of ``page`` that starts with
    ``start`` (its default and notes included)."""
    text = (ROOT / "docs" / page).read_text()
    row = next(line for line in text.splitlines() if line.startswith(start))
    return set(re.findall(r"`([a-z0-9_]+)`", row))


def test_every_tiny_family_and_demo_family_is_documented() -> None:
    """The ``--arch`` rows of tiny-model.md and of cli.md's ``demo`` list
    exactly what the code offers (families added later must show up there)."""
    from vllm_afd.cli.demo import demo_archs
    from vllm_afd.models.tiny_checkpoint import TINY_ARCHS

    listed = _arch_row("tiny-model.md", "| `arch` | `--arch` |")
    assert set(TINY_ARCHS) <= listed, set(TINY_ARCHS) - listed
    listed = _arch_row("cli.md", "| `--arch` | `deepseek_v2` | model family")
    assert set(demo_archs()) <= listed, set(demo_archs()) - listed
    offered_elsewhere = listed & (set(TINY_ARCHS) - set(demo_archs()))
    assert not offered_elsewhere, f"demo does not serve {offered_elsewhere}"
