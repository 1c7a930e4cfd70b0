"""An ``async`` FFN rank keeps its own routed experts only: taken before
the weights load (``FFNLayers.take_expert_slice``: vLLM's loader maps the
checkpoint's expert ids into the slice and skips the others, or is handed
the slice's rows of each all-expert tensor; an expert the loader left out is
named), or cut after (``FFNLayers.keep_experts``); weights and biases one
row per expert, quantized experts refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vllm_afd.errors import AFDConfigError
from vllm_afd.models.ffn_layers import FFNLayers

EXPERTS, HIDDEN, WIDTH = 8, 4, 6


def _layers(
    quant_method: object = None, **extra: torch.Tensor
) -> tuple[FFNLayers, nn.Module]:
    experts = nn.Module()
    experts.quant_method = quant_method
    experts.w13_weight = nn.Parameter(torch.randn(EXPERTS, 2 * WIDTH, HIDDEN))
    experts.w2_weight = nn.Parameter(torch.randn(EXPERTS, HIDDEN, WIDTH))
    experts.w13_weight.weight_loader = "vLLM's loader"  # set_weight_attrs
    for name, value in extra.items():
        setattr(experts, name, nn.Parameter(value))
    layers = FFNLayers.__new__(FFNLayers)  # the slicing alone: no model
    layers.runners = {1: SimpleNamespace(routed_experts=experts, shared_experts=None)}
    layers.split = SimpleNamespace(num_experts=EXPERTS)
    layers.expert_slice = None
    return layers, experts


def _load(experts: nn.Module, checkpoint: dict[str, torch.Tensor], skip=()) -> None:
    """What vLLM's expert weight loader does: every checkpoint expert's id
    mapped to the rank's own, -1 skipped (expert ids in ``skip`` left out, as
    a model loading its experts past the mapping would)."""
    for name, full in checkpoint.items():
        param = getattr(experts, name)
        for expert_id in range(EXPERTS):
            local = experts._map_global_expert_id_to_local_expert_id(expert_id)
            if local != -1 and expert_id not in skip:
                param.data[local].copy_(full[expert_id])


def test_a_slice_taken_before_loading_holds_its_experts_only():
    layers, experts = _layers()
    checkpoint = {n: p.detach().clone() for n, p in experts.named_parameters()}
    layers.take_expert_slice(2, 5)
    assert experts.w13_weight.shape == (3, 2 * WIDTH, HIDDEN)
    assert experts.w2_weight.shape == (3, HIDDEN, WIDTH)
    assert experts.w13_weight.weight_loader == "vLLM's loader"
    assert torch.isnan(experts.w2_weight).all()  # until loaded
    _load(experts, checkpoint)
    layers.check_slice_loaded()
    assert torch.equal(experts.w13_weight, checkpoint["w13_weight"][2:5])
    assert torch.equal(experts.w2_weight, checkpoint["w2_weight"][2:5])
    # the worker's keep_experts then keeps what loaded, counting every expert
    kept, before = layers.keep_experts(2, 5)
    assert torch.equal(experts.w2_weight, checkpoint["w2_weight"][2:5])
    assert 8 * kept == 3 * before and layers.first_expert == 2
    with pytest.raises(AFDConfigError, match=r"loaded 2\.\.4"):
        layers.keep_experts(0, 4)


def test_an_expert_the_loader_left_out_is_named():
    layers, experts = _layers()
    checkpoint = {n: p.detach().clone() for n, p in experts.named_parameters()}
    layers.take_expert_slice(4, 8)
    _load(experts, checkpoint, skip={6})
    with pytest.raises(AFDConfigError, match=r"layer 1: w13_weight .* not loaded"):
        layers.check_slice_loaded()


def test_a_rank_keeps_the_rows_of_its_experts():
    layers, experts = _layers()
    w13 = experts.w13_weight.detach().clone()
    kept, before = layers.keep_experts(4, 8)
    assert torch.equal(experts.w13_weight, w13[4:8])
    assert experts.w2_weight.shape[0] == 4
    assert 2 * kept == before and layers.first_expert == 4


def test_expert_biases_are_cut_with_the_weights():
    """gpt-oss's experts carry biases, one row per expert: cut alongside,
    in place (vLLM's MoE quant config holds the bias parameters it hands
    the CPU kernel), before the load or after it."""
    biases = {
        "w13_bias": torch.randn(EXPERTS, 2 * WIDTH),
        "w2_bias": torch.randn(EXPERTS, HIDDEN),
    }
    layers, experts = _layers(**biases)
    held = experts.w13_bias
    layers.keep_experts(4, 8)
    assert experts.w13_bias is held
    assert torch.equal(experts.w13_bias, biases["w13_bias"][4:8])
    assert torch.equal(experts.w2_bias, biases["w2_bias"][4:8])
    layers, experts = _layers(**biases)
    held = experts.w2_bias
    layers.take_expert_slice(2, 5)
    assert experts.w2_bias is held and experts.w2_bias.shape == (3, HIDDEN)


def test_a_loader_of_whole_expert_tensors_gets_the_rows_of_the_slice():
    """gpt-oss's loader copies ``[E, ...]`` tensors whole into the experts
    (``Family.whole_expert_tensors``): the rank hands it its own rows."""
    layers, _ = _layers()
    layers.take_expert_slice(2, 5)
    every = torch.arange(EXPERTS * 3.0).reshape(EXPERTS, 3)
    weights = [("experts.gate_up_proj", every), ("norm.weight", torch.ones(3))]
    out = dict(layers.own_expert_rows(weights, lambda n: n.startswith("experts.")))
    assert torch.equal(out["experts.gate_up_proj"], every[2:5])
    assert torch.equal(out["norm.weight"], torch.ones(3))
    short = [("experts.down_proj", torch.zeros(EXPERTS - 1, 3))]
    with pytest.raises(AFDConfigError, match=r"experts.down_proj has 7 rows"):
        list(layers.own_expert_rows(short, lambda n: True))


def test_quantized_experts_are_refused_naming_the_quantization():
    """FP8 or MXFP4 experts hold scales and a kernel's layout: refused at
    load, naming vLLM's quantization method."""

    class Fp8MoEMethod:  # the name is what the message reads
        pass

    layers, _ = _layers(
        Fp8MoEMethod(),
        w13_weight_scale=torch.ones(EXPERTS),
        w2_weight_scale=torch.ones(EXPERTS),
    )
    with pytest.raises(
        AFDConfigError,
        match=r"layer 1: the routed experts are quantized \(Fp8MoEMethod\) and "
        r"hold w13_weight_scale, w2_weight_scale besides their weights and biases",
    ):
        layers.take_expert_slice(0, 4)
