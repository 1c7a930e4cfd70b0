"""``tools/gpu/shard.py``: the GPU suite split into even shards (pure parts)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).parents[2] / "tools" / "gpu" / "shard.py"
_SPEC = importlib.util.spec_from_file_location("gpu_shard", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
shard = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(shard)


def test_every_test_lands_in_exactly_one_shard_and_the_shards_are_even():
    ids = [f"tests/gpu/test_one_gpu_gpu.py::t[{k}]" for k in range(6)]
    ids += [f"tests/connector/test_cuda_ipc.py::c[{k}]" for k in range(9)]
    ids += ["tests/gpu/test_cuda_workers.py::w"]
    parts = shard.split(ids, 3)
    assert sorted(n for p in parts for n in p) == sorted(ids)
    loads = [sum(map(shard.estimate, p)) for p in parts]
    assert max(loads) - min(loads) <= max(map(shard.estimate, ids))
    for p in parts:  # collection order kept within a shard
        assert p == [n for n in ids if n in p]


def test_the_longest_prefix_gives_the_estimate():
    assert shard.estimate("tests/gpu/test_async_gpu.py::test_async_refuses_x") == 5
    assert shard.estimate("tests/gpu/test_async_gpu.py::test_async_on_one") == 100
    assert shard.estimate("tests/connector/test_cuda_ipc.py::x") == 10


@pytest.mark.parametrize("text", ["0/3", "4/3", "1", "a/b", "1/0"])
def test_a_bad_shard_is_refused_naming_the_form(text):
    with pytest.raises(ValueError, match="expected I/N"):
        shard.parse_shard(text)
    assert shard.parse_shard("2/3") == (2, 3)


def test_tests_this_host_skips_weigh_nothing_and_the_gpu_default_is_two():
    assert shard.gpus_needed("tests/gpu/test_x.py::t", None) == 2
    assert shard.gpus_needed("tests/gpu/test_x.py::t", 1) == 1
    assert shard.gpus_needed("tests/connector/test_cuda_ipc.py::t", None) == 1
    ids = ["a", "b", "c", "d"]
    parts = shard.split(ids, 2, {"a": 100.0, "b": 100.0, "c": 0.1, "d": 0.1})
    assert sorted(len(p) for p in parts) == [2, 2]
    assert all(("a" in p) != ("b" in p) for p in parts)


def test_a_shard_holds_only_tests_the_gpu_marker_selects():
    """The shards split what ``pytest -m gpu`` runs, not every collected test
    (a deselected one would weigh on the balance and run nowhere)."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, str(_PATH), "1/1"],
        capture_output=True, text=True, timeout=240, cwd=_PATH.parents[2],
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    ids = run.stdout.split()
    silent = "test_cuda_ipc_wait_for_a_silent_peer_ends_after_timeout_s"
    assert f"tests/connector/test_cuda_ipc.py::{silent}" in ids
    # the loopback contract tests carry no gpu marker
    assert not [n for n in ids if n.endswith("-loopback]")], ids
