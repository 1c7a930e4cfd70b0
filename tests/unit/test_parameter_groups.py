"""Which group a role-split DeepSeek parameter counts in (per-role bytes)."""

from __future__ import annotations

import pytest

from vllm_afd.models.deepseek import PARAMETER_GROUPS, parameter_group


@pytest.mark.parametrize(
    ("name", "group"),
    [
        ("model.embed_tokens.weight", "embed_tokens"),
        ("lm_head.weight", "lm_head"),
        ("model.norm.weight", "norms"),
        ("model.layers.0.input_layernorm.weight", "norms"),
        ("model.layers.1.post_attention_layernorm.weight", "norms"),
        ("model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "attention"),
        ("model.layers.1.self_attn.kv_a_layernorm.weight", "attention"),
        ("model.layers.0.mlp.gate_up_proj.weight", "dense_mlp"),
        ("model.layers.0.mlp.down_proj.weight", "dense_mlp"),
        ("model.layers.2.mlp.gate.weight", "gate"),
        ("model.layers.2.mlp.gate.e_score_correction_bias", "gate"),
        ("model.layers.2.mlp.shared_experts.gate_up_proj.weight", "shared_experts"),
        ("model.layers.2.mlp.experts.routed_experts.w13_weight", "routed_experts"),
        ("model.layers.2.mlp.experts.routed_experts.w2_weight", "routed_experts"),
    ],
)
def test_parameter_group_of_native_parameter_names(name: str, group: str) -> None:
    assert parameter_group(name) == group
    assert group in PARAMETER_GROUPS
