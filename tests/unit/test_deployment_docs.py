"""Every ``vllm-afd launch`` command of docs/deployment.md is valid: run with
``--dry-run`` (for each of its nodes across hosts), it prints the processes."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from vllm_afd.cli import main as cli
from vllm_afd.deploy import placement

DOC = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"
THREE_HOSTS = "10.0.0.1,10.0.0.2,10.0.0.3"


def _commands() -> list[list[str]]:
    text = DOC.read_text()
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            if "vllm-afd launch" in line:
                words = shlex.split(line.replace('"$HOSTS"', THREE_HOSTS))
                found.append(words[words.index("vllm-afd") + 1 :])
    for block in re.findall(r"```yaml\n(.*?)```", text, re.S):
        match = re.search(r"command: (\[.*?\])", block, re.S)
        if match:
            found.append(json.loads(match.group(1))[1:])
    return found


def _across_hosts() -> list[list[str]]:
    return [argv for argv in _commands() if "--hosts" in argv]


def _pd() -> list[list[str]]:
    return [argv for argv in _commands() if "--prefill" in argv]


def _pd_name(argv: list[str]) -> str:
    """``--prefill``'s value, `` plain`` after it with ``--plain-decode``."""
    name = argv[argv.index("--prefill") + 1]
    return f"{name} plain" if "--plain-decode" in argv else name


def test_the_page_has_the_bare_host_slurm_kubernetes_and_pd_commands():
    assert len(_across_hosts()) == 3
    # plain prefill servers, an AFD prefill deployment, PD without AFD
    assert [_pd_name(argv) for argv in _pd()] == ["1", "1A2F:async", "1 plain"]


#: the roles each PD command of the page starts, in start order
PD_ROLES = {
    "1": ["prefill", "ffn", "attention", "router"],
    "1A2F:async": [
        "prefill-ffn0", "prefill-ffn1", "prefill-attention",
        "ffn", "attention", "router",
    ],
    "1 plain": ["prefill", "decode (plain vLLM, the KV consumer)", "router"],
}  # fmt: skip


@pytest.mark.parametrize("argv", _pd(), ids=_pd_name)
def test_the_pd_commands_of_the_page_are_valid(argv, capsys):
    cut = argv.index("--")
    assert cli.main([*argv[:cut], "--dry-run", *argv[cut:]]) == 0
    out = capsys.readouterr().out
    roles = PD_ROLES[_pd_name(argv)]
    heads = [line[2:] for line in out.splitlines() if line.startswith("# ")]
    assert [h for h in heads if h in roles] == roles


@pytest.mark.parametrize("argv", _across_hosts(), ids=["bare", "slurm", "kubernetes"])
def test_every_launch_command_of_the_page_is_valid_on_every_node(
    argv, capsys, monkeypatch
):
    monkeypatch.setattr(placement, "interface_of", lambda address: "eth0")
    argv = _without_node_rank(argv)
    hosts = argv[argv.index("--hosts") + 1].split(",")
    cut = argv.index("--")
    for node in range(len(hosts)):
        given = [*argv[:cut], "--node-rank", str(node), "--dry-run", *argv[cut:]]
        assert cli.main(given) == 0
        out = capsys.readouterr().out
        assert f"## node {node} ({hosts[node]})" in out
        assert out.count(" serve MODEL ") >= 1


def _without_node_rank(argv: list[str]) -> list[str]:
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
            continue
        if word == "--node-rank":
            skip = True
            continue
        out.append(word)
    return out
