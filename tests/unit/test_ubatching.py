"""Micro-batching on one attention rank (``afd.num_ubatches = 2``).

vLLM's own functions decide the split; these tests hold our replay plans and
our dispatch to them, and check the patches against the installed vLLM.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm.config import CUDAGraphMode  # noqa: E402
from vllm.v1.worker.ubatch_utils import maybe_create_ubatch_slices  # noqa: E402

from vllm_afd.compat.patching import check_patch  # noqa: E402
from vllm_afd.worker.ubatching import (  # noqa: E402
    BUILD_UBATCH_RUNNER,
    DISPATCH,
    FORWARD_CONTEXTS,
    dispatch_with_ubatches,
    make_forward_contexts,
    ubatch_token_counts,
)


@pytest.mark.parametrize("patch", [BUILD_UBATCH_RUNNER, DISPATCH, FORWARD_CONTEXTS])
def test_patches_match_the_installed_vllm(patch):
    check_patch(patch)


@pytest.mark.parametrize("num_tokens", [2, 3, 16, 31, 32, 33, 255, 512])
def test_replay_split_is_vllms_split_of_a_padded_decode(num_tokens):
    """A FULL graph replay plans the split vLLM made when it captured."""
    scheduled = np.ones(num_tokens, dtype=np.int32)
    _, padded = maybe_create_ubatch_slices(True, scheduled, num_tokens, num_tokens, 2)
    assert ubatch_token_counts(num_tokens, 2) == tuple(s.num_tokens for s in padded)


class _Manager:
    """Answers like vLLM's graph manager: a FULL graph padded to ``padded``."""

    def __init__(self, padded: int | None) -> None:
        self.padded = padded
        self.calls: list[dict] = []

    def dispatch(self, num_reqs, num_tokens, uniform, **kwargs):
        self.calls.append(kwargs)
        n = kwargs.get("num_ubatches", 1)
        if self.padded is None:
            return SimpleNamespace(
                cg_mode=CUDAGraphMode.NONE, num_tokens=num_tokens,
                num_active_loras=0, num_ubatches=n,
            )  # fmt: skip
        return SimpleNamespace(
            cg_mode=CUDAGraphMode.FULL, num_tokens=self.padded,
            num_active_loras=0, num_ubatches=n,
        )  # fmt: skip


def _parallel(decode: int = 32, prefill: int = 512):
    return SimpleNamespace(
        use_ubatching=True, num_ubatches=2,
        dbo_decode_token_threshold=decode, dbo_prefill_token_threshold=prefill,
    )  # fmt: skip


def _dispatch(manager, num_tokens, *, uniform_decode=True, **kw):
    original_calls = []

    def original(*args, **kwargs):
        original_calls.append(args)
        return "native", None

    dp_size = kw.pop("dp_size", 1)
    args = dict(
        parallel_config=_parallel(), allow_ubatching=True,
        uniform_decode=uniform_decode,
    )  # fmt: skip
    args.update(kw)
    desc, sync = dispatch_with_ubatches(
        original, manager, num_tokens, num_tokens, 1 if uniform_decode else None,
        dp_size, 0, **args,
    )  # fmt: skip
    return desc, sync, original_calls


def test_decode_at_the_threshold_is_split_into_two_micro_batches():
    manager = _Manager(padded=None)
    desc, sync, native = _dispatch(manager, 32)
    assert desc.num_ubatches == 2 and sync is None and not native
    assert manager.calls[0]["num_ubatches"] == 2


@pytest.mark.parametrize(
    "num_tokens,kw",
    [
        (31, {}),  # below the decode threshold
        (100, {"uniform_decode": False}),  # below the prefill threshold
        (64, {"need_eager": True}),  # profile run
        (64, {"allow_ubatching": False}),  # dummy run without attention
        (64, {"dp_size": 2}),  # vLLM's own cross-rank vote
    ],
)
def test_other_steps_take_vllms_path(num_tokens, kw):
    manager = _Manager(padded=None)
    desc, _, native = _dispatch(manager, num_tokens, **kw)
    assert desc == "native" and len(native) == 1


def test_a_graph_padded_past_twice_the_tokens_runs_eager_micro_batches():
    desc, _, _ = _dispatch(_Manager(padded=128), 40)
    assert desc.cg_mode == CUDAGraphMode.NONE and desc.num_ubatches == 2
    assert desc.num_tokens == 40
    desc, _, _ = _dispatch(_Manager(padded=64), 40)
    assert desc.cg_mode == CUDAGraphMode.FULL and desc.num_tokens == 64


def test_forward_contexts_carry_each_micro_batch_and_no_dp_metadata():
    import torch
    from vllm.config import VllmConfig

    padding = [torch.zeros(2, dtype=torch.bool), torch.ones(3, dtype=torch.bool)]
    contexts = make_forward_contexts(
        VllmConfig(), [{"mla": 0}, {"mla": 1}], [{"s": 0}, {"s": 1}], padding
    )
    assert [c.attn_metadata for c in contexts] == [{"mla": 0}, {"mla": 1}]
    assert [c.slot_mapping for c in contexts] == [{"s": 0}, {"s": 1}]
    assert all(c.dp_metadata is None for c in contexts)
    assert contexts[1].is_padding is padding[1]
