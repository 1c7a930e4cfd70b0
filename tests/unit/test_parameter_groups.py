"""Which group a role-split parameter counts in (per-role bytes)."""

from __future__ import annotations

import pytest

from vllm_afd.models.ownership import SplitPrefixes

split = pytest.importorskip("vllm_afd.models.split")

DEEPSEEK = SplitPrefixes(
    moe_blocks=("model.layers.2.mlp",),
    gates=("model.layers.2.mlp.gate",),
    dense_mlps=("model.layers.0.mlp",),
    routed_experts=("model.layers.2.mlp.experts",),
)
MIXTRAL = SplitPrefixes(
    moe_blocks=("model.layers.0.block_sparse_moe",),
    gates=("model.layers.0.block_sparse_moe.gate",),
    dense_mlps=(),
    routed_experts=("model.layers.0.block_sparse_moe.experts",),
)

EXAONE = SplitPrefixes(
    moe_blocks=("model.layers.1.mlp",),
    gates=("model.layers.1.mlp.gate", "model.layers.1.mlp.e_score_correction_bias"),
    dense_mlps=("model.layers.0.mlp",),
    routed_experts=("model.layers.1.mlp.experts",),
)


@pytest.mark.parametrize(
    ("prefixes", "name", "group"),
    [
        (DEEPSEEK, "model.embed_tokens.weight", "embed_tokens"),
        (DEEPSEEK, "lm_head.weight", "lm_head"),
        (DEEPSEEK, "model.norm.weight", "norms"),
        (DEEPSEEK, "model.layers.0.input_layernorm.weight", "norms"),
        (DEEPSEEK, "model.layers.1.post_attention_layernorm.weight", "norms"),
        (DEEPSEEK, "model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "attention"),
        (DEEPSEEK, "model.layers.1.self_attn.kv_a_layernorm.weight", "attention"),
        (DEEPSEEK, "model.layers.0.mlp.gate_up_proj.weight", "dense_mlp"),
        (DEEPSEEK, "model.layers.2.mlp.gate.weight", "gate"),
        (DEEPSEEK, "model.layers.2.mlp.gate.e_score_correction_bias", "gate"),
        (
            DEEPSEEK,
            "model.layers.2.mlp.shared_experts.gate_up_proj.weight",
            "shared_experts",
        ),
        (
            DEEPSEEK,
            "model.layers.2.mlp.experts.routed_experts.w13_weight",
            "routed_experts",
        ),
        (MIXTRAL, "model.layers.0.block_sparse_moe.gate.weight", "gate"),
        (
            MIXTRAL,
            "model.layers.0.block_sparse_moe.experts.routed_experts.w2_weight",
            "routed_experts",
        ),
        (MIXTRAL, "model.layers.0.self_attn.qkv_proj.weight", "attention"),
        # a router parameter of the block itself (EXAONE-MoE's score bias)
        (EXAONE, "model.layers.1.mlp.e_score_correction_bias", "gate"),
        (
            EXAONE,
            "model.layers.1.mlp.shared_experts.gate_up_proj.weight",
            "shared_experts",
        ),
    ],
)
def test_parameter_group_of_native_parameter_names(prefixes, name, group) -> None:
    assert split.parameter_group(name, prefixes) == group
    assert group in split.PARAMETER_GROUPS
