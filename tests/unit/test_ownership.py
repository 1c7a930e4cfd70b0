"""Unit tests for checkpoint weight ownership (vllm_afd.models.ownership)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_afd.config import AFDRole
from vllm_afd.models.ownership import LayerLayout, weight_owner

A, F = AFDRole.ATTENTION, AFDRole.FFN

# Three decoder layers: layer 0 dense, layers 1 and 2 MoE; layer 3 is MTP.
LAYOUT = LayerLayout(num_layers=3, first_k_dense_replace=1)

# name -> (owner with the gate on FFN, owner with the gate on attention)
OWNERS = {
    "model.embed_tokens.weight": (A, A),
    "model.norm.weight": (A, A),
    "lm_head.weight": (A, A),
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (A, A),
    "model.layers.2.self_attn.q_proj.weight": (A, A),
    "model.layers.1.input_layernorm.weight": (A, A),
    "model.layers.1.post_attention_layernorm.weight": (A, A),
    "model.layers.0.mlp.gate_proj.weight": (F, A),
    "model.layers.0.mlp.down_proj.weight": (F, A),
    "model.layers.2.mlp.gate.weight": (F, A),
    "model.layers.2.mlp.gate.e_score_correction_bias": (F, A),
    "model.layers.2.mlp.experts.3.up_proj.weight": (F, F),
    "model.layers.1.mlp.experts.0.gate_proj.weight": (F, F),
    "model.layers.2.mlp.shared_experts.down_proj.weight": (F, F),
    # MTP module (layer index >= num_hidden_layers): attention's loader skips it.
    "model.layers.3.mlp.experts.0.up_proj.weight": (A, A),
    "model.layers.3.mlp.gate.weight": (A, A),
    "model.layers.3.eh_proj.weight": (A, A),
    "model.layers.3.enorm.weight": (A, A),
}


@pytest.mark.parametrize(
    ("name", "gate_on_attention", "owner"),
    [
        pytest.param(name, gate, owners[gate], id=f"{name}-gate_on_attention={gate}")
        for name, owners in OWNERS.items()
        for gate in (False, True)
    ],
)
def test_weight_owner_matches_table(
    name: str, gate_on_attention: bool, owner: AFDRole
) -> None:
    got = weight_owner(name, LAYOUT, compute_gate_on_attention=gate_on_attention)
    assert got is owner


def test_weight_owner_mlp_name_prefix_is_not_matched_loosely() -> None:
    # "mlp_foo" is not the "mlp." submodule; it stays with attention.
    got = weight_owner(
        "model.layers.1.mlp_extra.weight", LAYOUT, compute_gate_on_attention=False
    )
    assert got is A


def test_weight_owner_dense_model_without_experts_sends_every_mlp_to_ffn() -> None:
    layout = LayerLayout(num_layers=2, first_k_dense_replace=0, has_experts=False)
    assert layout.moe_layers == ()
    for layer in range(2):
        name = f"model.layers.{layer}.mlp.up_proj.weight"
        assert weight_owner(name, layout, compute_gate_on_attention=False) is F
        assert weight_owner(name, layout, compute_gate_on_attention=True) is A


def test_weight_owner_moe_layer_freq_2_treats_odd_layers_as_dense() -> None:
    layout = LayerLayout(num_layers=6, first_k_dense_replace=1, moe_layer_freq=2)
    dense_gate = "model.layers.3.mlp.gate_proj.weight"
    router = "model.layers.4.mlp.gate.weight"
    assert weight_owner(dense_gate, layout, compute_gate_on_attention=True) is A
    assert weight_owner(router, layout, compute_gate_on_attention=True) is A
    expert = "model.layers.4.mlp.experts.0.up_proj.weight"
    assert weight_owner(expert, layout, compute_gate_on_attention=True) is F


@pytest.mark.parametrize(
    ("layout", "moe"),
    [
        (LayerLayout(num_layers=3, first_k_dense_replace=1), (1, 2)),
        (LayerLayout(num_layers=4, first_k_dense_replace=0), (0, 1, 2, 3)),
        (LayerLayout(num_layers=6, first_k_dense_replace=1, moe_layer_freq=2), (2, 4)),
        (LayerLayout(num_layers=7, first_k_dense_replace=3, moe_layer_freq=2), (4, 6)),
        (LayerLayout(num_layers=4, first_k_dense_replace=4), ()),
        (LayerLayout(num_layers=4, first_k_dense_replace=0, has_experts=False), ()),
    ],
)
def test_layer_layout_moe_layers_match_table(
    layout: LayerLayout, moe: tuple[int, ...]
) -> None:
    assert layout.moe_layers == moe
    assert layout.remote_layers(compute_gate_on_attention=True) == moe
    assert layout.remote_layers(compute_gate_on_attention=False) == tuple(
        range(layout.num_layers)
    )


def test_layer_layout_from_hf_config_reads_fields_and_defaults() -> None:
    full = SimpleNamespace(
        num_hidden_layers=6,
        first_k_dense_replace=1,
        moe_layer_freq=2,
        n_routed_experts=8,
    )
    assert LayerLayout.from_hf_config(full) == LayerLayout(
        num_layers=6, first_k_dense_replace=1, moe_layer_freq=2, has_experts=True
    )
    bare = SimpleNamespace(num_hidden_layers=2, n_routed_experts=None)
    assert LayerLayout.from_hf_config(bare) == LayerLayout(
        num_layers=2, first_k_dense_replace=0, moe_layer_freq=1, has_experts=False
    )
