"""Request-boundary stages of the async connector (``worker.stages``): where a
step is cut, when a prefix-cache hit keeps it whole, and the baton that runs
one stage at a time. The stages' exactness against plain vLLM is
tests/e2e/test_families.py's Qwen3-MoE ``async+stages`` case."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from vllm_afd.worker.stages import (
    StageBaton,
    reads_later_writes,
    stage_inputs,
    stage_split,
)


@pytest.mark.parametrize(
    ("tokens", "split"),
    [
        ([100, 100], 100),
        ([10, 300, 20, 30], 310),  # ends 10, 310, 330 around 180: 310
        ([1, 1, 1, 1], 2),
        ([500, 1, 1], 500),  # one long prefill and two decodes: 500 | 2
        ([3, 3, 3], 3),  # 3 and 6 tie around 4.5: the earlier one
    ],
)
def test_a_step_is_cut_at_the_request_boundary_nearest_half_its_tokens(
    tokens: list[int], split: int
) -> None:
    arr = np.array(tokens)
    assert stage_split(arr) == split
    ends = set(np.cumsum(arr)[:-1].tolist())
    assert stage_split(arr) in ends  # never inside a request


def test_a_step_of_one_request_runs_whole() -> None:
    assert stage_split(np.array([4096])) is None


def _tables(*rows: list[int], block_size: int = 4) -> list[tuple[np.ndarray, int]]:
    width = max(len(r) for r in rows)
    table = np.array([r + [0] * (width - len(r)) for r in rows])
    return [(table, block_size)]


def test_a_first_stage_prefix_hit_on_blocks_the_second_stage_writes_keeps_it_whole():
    # request 0 (first stage) hit blocks 7 and 8, which request 1 (second
    # stage) computes in this very step
    computed = np.array([8, 0])
    query = np.array([3, 8])
    tables = _tables([7, 8, 9], [7, 8])
    assert reads_later_writes(1, computed, query, tables)


def test_a_second_stage_hit_on_first_stage_writes_is_safe() -> None:
    # the first stage writes each layer's KV before the second reads it
    computed = np.array([0, 8])
    query = np.array([8, 3])
    tables = _tables([7, 8], [7, 8, 9])
    assert not reads_later_writes(1, computed, query, tables)


def test_first_stage_reads_of_own_or_older_blocks_are_safe() -> None:
    computed = np.array([8, 4])
    query = np.array([1, 1])
    tables = _tables([1, 2, 3], [5, 6])
    assert not reads_later_writes(1, computed, query, tables)


def test_stage_inputs_slice_every_token_tensor() -> None:
    kw = {
        "input_ids": torch.arange(6),
        "positions": torch.arange(12).view(2, 6),  # M-RoPE: [3 or 2, T]
        "inputs_embeds": None,
        "intermediate_tensors": None,
        "other": "kept",
    }
    out = stage_inputs(slice(2, 5), kw)
    assert out["input_ids"].tolist() == [2, 3, 4]
    assert out["positions"].tolist() == [[2, 3, 4], [8, 9, 10]]
    assert out["other"] == "kept" and out["inputs_embeds"] is None


def test_the_baton_interleaves_stages_at_each_yield_and_keeps_their_order() -> None:
    order: list[str] = []
    holders: list[int] = []
    baton = StageBaton(holders.append)

    def stage(i: int, layers: int):
        def run() -> torch.Tensor:
            assert baton.active() and baton.index() == i
            for layer in range(layers):
                order.append(f"s{i}L{layer}")
                baton.yield_()
            return torch.tensor([i])

        return run

    out = baton.run([stage(0, 3), stage(1, 3)])
    assert [t.item() for t in out] == [0, 1]
    assert order == ["s0L0", "s1L0", "s0L1", "s1L1", "s0L2", "s1L2"]
    assert holders[:3] == [0, 1, 0]  # each taker set its forward context
    assert not baton.active()


def test_a_stage_that_ends_early_lets_the_other_run_on_alone() -> None:
    order: list[str] = []
    baton = StageBaton(lambda i: None)

    def short() -> torch.Tensor:
        order.append("s0")
        return torch.zeros(1)

    def long() -> torch.Tensor:
        for layer in range(3):
            order.append(f"s1L{layer}")
            baton.yield_()  # nobody else is left: returns at once
        return torch.ones(1)

    baton.run([short, long])
    assert order == ["s0", "s1L0", "s1L1", "s1L2"]


def test_a_stage_error_reaches_the_caller_after_both_stages_ended() -> None:
    finished = threading.Event()
    baton = StageBaton(lambda i: None)

    def failing() -> torch.Tensor:
        baton.yield_()
        raise RuntimeError("stage 0 failed")

    def other() -> torch.Tensor:
        baton.yield_()
        baton.yield_()
        finished.set()
        return torch.zeros(1)

    with pytest.raises(RuntimeError, match="stage 0 failed"):
        baton.run([failing, other])
    assert finished.is_set()
