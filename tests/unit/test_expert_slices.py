"""An ``async`` FFN rank keeps its own routed experts only
(``FFNLayers.keep_experts``): one row per expert sliced, anything else
refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vllm_afd.errors import AFDConfigError
from vllm_afd.models.ffn_layers import FFNLayers

EXPERTS, HIDDEN, WIDTH = 8, 4, 6


def _layers(**extra: torch.Tensor) -> tuple[FFNLayers, nn.Module]:
    experts = nn.Module()
    experts.w13_weight = nn.Parameter(torch.randn(EXPERTS, 2 * WIDTH, HIDDEN))
    experts.w2_weight = nn.Parameter(torch.randn(EXPERTS, HIDDEN, WIDTH))
    for name, value in extra.items():
        setattr(experts, name, nn.Parameter(value))
    layers = FFNLayers.__new__(FFNLayers)  # the slicing alone: no model
    layers.runners = {1: SimpleNamespace(routed_experts=experts, shared_experts=None)}
    return layers, experts


def test_a_rank_keeps_the_rows_of_its_experts():
    layers, experts = _layers()
    w13 = experts.w13_weight.detach().clone()
    kept, before = layers.keep_experts(4, 8)
    assert torch.equal(experts.w13_weight, w13[4:8])
    assert experts.w2_weight.shape[0] == 4
    assert 2 * kept == before and layers.first_expert == 4


def test_experts_with_biases_are_refused_naming_them():
    """gpt-oss's experts carry biases: refused at load, by name."""
    layers, _ = _layers(
        w13_bias=torch.zeros(EXPERTS, 2 * WIDTH), w2_bias=torch.zeros(EXPERTS, HIDDEN)
    )
    with pytest.raises(AFDConfigError, match=r"layer 1: .* hold w13_bias, w2_bias"):
        layers.keep_experts(0, 4)
