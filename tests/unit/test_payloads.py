"""The connector's records moved between devices (the async connector stages
work items through host memory on a GPU)."""

from __future__ import annotations

import torch

from vllm_afd.connector.payloads import A2FBatch, Routing


def _batch(routed: bool) -> A2FBatch:
    routing = Routing(torch.rand(3, 2), torch.tensor([[0, 1]] * 3, dtype=torch.int32))
    return A2FBatch(torch.rand(3, 4, dtype=torch.bfloat16), routing if routed else None)


def test_a_batch_moves_with_its_routing_and_keeps_dtypes():
    batch = _batch(routed=True)
    moved = batch.to("meta")
    assert moved.routing is not None and batch.routing is not None
    tensors = (moved.hidden, moved.routing.topk_weights, moved.routing.topk_ids)
    assert all(t.device.type == "meta" for t in tensors)
    assert [t.dtype for t in tensors] == [torch.bfloat16, torch.float32, torch.int32]
    assert [t.shape for t in tensors] == [(3, 4), (3, 2), (3, 2)]


def test_a_batch_already_there_is_not_copied():
    batch = _batch(routed=True)
    same = batch.to("cpu")
    assert same.hidden is batch.hidden
    assert same.routing is not None and batch.routing is not None
    assert same.routing.topk_ids is batch.routing.topk_ids


def test_a_batch_without_routing_moves_without_one():
    assert _batch(routed=False).to("meta").routing is None
