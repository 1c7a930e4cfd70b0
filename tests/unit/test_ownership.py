"""Unit tests for checkpoint weight ownership (vllm_afd.models.ownership).

One table per family: the prefixes the role split records while vLLM builds
that family's tiny model (3 layers: layer 0 dense where the family has dense
layers), and checkpoint names as the family's published checkpoints spell
them, with their owner for each gate placement.
"""

from __future__ import annotations

import pytest

from vllm_afd.models.ownership import SplitPrefixes, vllm_weight_name, weight_owner
from vllm_afd.roles import AFDRole

A, F = AFDRole.ATTENTION, AFDRole.FFN


def _prefixes(
    block: str, dense: bool, gate: str = "gate", gate_parts: tuple[str, ...] = ()
) -> SplitPrefixes:
    """As ``derive_split`` records them (``gate`` and ``gate_parts`` from the
    family record)."""
    moe = (1, 2) if dense else (0, 1, 2)
    blocks = tuple(f"model.layers.{i}.{block}" for i in moe)
    return SplitPrefixes(
        moe_blocks=blocks,
        gates=tuple(f"{b}.{g}" for b in blocks for g in (gate, *gate_parts)),
        dense_mlps=("model.layers.0.mlp",) if dense else (),
        routed_experts=tuple(f"{b}.experts" for b in blocks),
    )


_COMMON = {
    "model.embed_tokens.weight": (A, A),
    "model.norm.weight": (A, A),
    "lm_head.weight": (A, A),
    "model.layers.1.input_layernorm.weight": (A, A),
    "model.layers.1.post_attention_layernorm.weight": (A, A),
}

#: family -> (prefixes, {name: (owner, gate on FFN; owner, gate on attention)})
TABLES = {
    "deepseek": (
        _prefixes("mlp", dense=True),
        {
            **_COMMON,
            "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (A, A),
            "model.layers.2.self_attn.q_proj.weight": (A, A),
            "model.layers.0.mlp.gate_proj.weight": (F, A),
            "model.layers.0.mlp.down_proj.weight": (F, A),
            "model.layers.2.mlp.gate.weight": (F, A),
            "model.layers.2.mlp.gate.e_score_correction_bias": (F, A),
            "model.layers.2.mlp.experts.3.up_proj.weight": (F, F),
            "model.layers.1.mlp.experts.0.gate_proj.weight": (F, F),
            "model.layers.2.mlp.shared_experts.down_proj.weight": (F, F),
            # DeepSeek-V3's MTP layer: vLLM builds no layer 3 here; the
            # attention role's native loader skips it.
            "model.layers.3.mlp.experts.0.up_proj.weight": (A, A),
            "model.layers.3.mlp.gate.weight": (A, A),
            "model.layers.3.eh_proj.weight": (A, A),
        },
    ),
    "qwen3_moe": (
        _prefixes("mlp", dense=True),
        {
            **_COMMON,
            "model.layers.1.self_attn.q_norm.weight": (A, A),
            "model.layers.1.self_attn.qkv_proj.weight": (A, A),
            "model.layers.0.mlp.up_proj.weight": (F, A),
            "model.layers.1.mlp.gate.weight": (F, A),
            "model.layers.1.mlp.experts.7.down_proj.weight": (F, F),
        },
    ),
    "qwen2_moe": (
        _prefixes("mlp", dense=True),
        {
            **_COMMON,
            "model.layers.1.self_attn.q_proj.bias": (A, A),
            "model.layers.0.mlp.gate_proj.weight": (F, A),
            "model.layers.2.mlp.gate.weight": (F, A),
            "model.layers.2.mlp.experts.0.gate_proj.weight": (F, F),
            "model.layers.2.mlp.shared_expert.up_proj.weight": (F, F),
            # the shared expert's own sigmoid gate is not the router gate
            "model.layers.2.mlp.shared_expert_gate.weight": (F, F),
        },
    ),
    "mixtral": (
        _prefixes("block_sparse_moe", dense=False),
        {
            **_COMMON,
            "model.layers.0.self_attn.o_proj.weight": (A, A),
            "model.layers.0.block_sparse_moe.gate.weight": (F, A),
            "model.layers.0.block_sparse_moe.experts.5.w1.weight": (F, F),
            "model.layers.2.block_sparse_moe.experts.0.w2.weight": (F, F),
        },
    ),
    "glm4_moe": (
        _prefixes("mlp", dense=True),
        {
            **_COMMON,
            "model.layers.0.self_attn.k_norm.weight": (A, A),
            "model.layers.0.mlp.down_proj.weight": (F, A),
            "model.layers.1.mlp.gate.weight": (F, A),
            "model.layers.1.mlp.gate.e_score_correction_bias": (F, A),
            "model.layers.1.mlp.experts.15.up_proj.weight": (F, F),
            "model.layers.1.mlp.shared_experts.gate_proj.weight": (F, F),
        },
    ),
    "ernie4_5_moe": (
        _prefixes("mlp", dense=True, gate_parts=("moe_statics",)),
        {
            **_COMMON,
            "model.layers.0.mlp.up_proj.weight": (F, A),
            "model.layers.1.mlp.gate.weight": (F, A),
            # the score bias, stored beside the gate: routing, so with it
            "model.layers.1.mlp.moe_statics.e_score_correction_bias": (F, A),
            "model.layers.1.mlp.experts.7.down_proj.weight": (F, F),
            "model.layers.1.mlp.shared_experts.up_proj.weight": (F, F),
        },
    ),
    "gpt_oss": (
        _prefixes("mlp", dense=False, gate="router"),
        {
            "model.embedding.weight": (A, A),
            "model.layers.0.attn.sinks": (A, A),
            "model.layers.0.attn.qkv_proj.bias": (A, A),
            "model.layers.0.mlp.router.weight": (F, A),
            "model.layers.0.mlp.router.bias": (F, A),
            "model.layers.2.mlp.experts.gate_up_proj_bias": (F, F),
            "model.layers.2.mlp.experts.down_proj": (F, F),
        },
    ),
    "exaone_moe": (
        _prefixes("mlp", dense=True, gate_parts=("e_score_correction_bias",)),
        {
            **_COMMON,
            "model.layers.0.mlp.up_proj.weight": (F, A),
            "model.layers.1.mlp.gate.weight": (F, A),
            # a parameter of the block itself, not of a module: the name is
            # the prefix, whole
            "model.layers.1.mlp.e_score_correction_bias": (F, A),
            "model.layers.1.mlp.e_score_correction_bias_x": (F, F),
            "model.layers.1.mlp.experts.7.down_proj.weight": (F, F),
            "model.layers.1.mlp.shared_experts.up_proj.weight": (F, F),
        },
    ),
    # Step-3: the MoE block is ``moe`` (its routed experts packed, one tensor
    # per projection); each MoE layer's shared expert lies beside it, built as
    # the layer's dense MLP (Step-3 builds its decoder under the prefix "":
    # derive_split names these modules as the model holds them)
    "step3_text": (
        SplitPrefixes(
            moe_blocks=("model.layers.1.moe", "model.layers.2.moe"),
            gates=("model.layers.1.moe.gate", "model.layers.2.moe.gate"),
            dense_mlps=(
                "model.layers.0.mlp",
                "model.layers.1.share_expert",
                "model.layers.2.share_expert",
            ),
            routed_experts=("model.layers.1.moe.experts", "model.layers.2.moe.experts"),
        ),
        {
            **_COMMON,
            "model.layers.1.self_attn.q_proj.weight": (A, A),
            "model.layers.1.self_attn.inter_norm.weight": (A, A),
            "model.layers.1.self_attn.wq.weight": (A, A),
            "model.layers.0.mlp.gate_proj.weight": (F, A),
            "model.layers.1.share_expert.up_proj.weight": (F, A),
            "model.layers.1.moe.gate.weight": (F, A),
            "model.layers.1.moe.gate_proj.weight": (F, F),
            "model.layers.2.moe.down_proj.weight": (F, F),
        },
    ),
    # ``layer_holds_moe``: the decoder layer holds router, dense MLP and
    # experts; the MoE block is vLLM's MoE layer alone
    "gemma4": (
        SplitPrefixes(
            moe_blocks=tuple(f"model.layers.{i}.experts" for i in range(3)),
            gates=tuple(f"model.layers.{i}.router" for i in range(3)),
            dense_mlps=tuple(f"model.layers.{i}.mlp" for i in range(3)),
            routed_experts=tuple(f"model.layers.{i}.experts" for i in range(3)),
        ),
        {
            **_COMMON,
            "model.layers.1.self_attn.q_proj.weight": (A, A),
            "model.layers.1.pre_feedforward_layernorm_2.weight": (A, A),
            "model.layers.1.per_layer_input_gate.weight": (A, A),
            "model.layers.1.layer_scalar": (A, A),
            "model.per_layer_model_projection.weight": (A, A),
            "model.layers.1.mlp.gate_proj.weight": (F, A),
            "model.layers.1.router.proj.weight": (F, A),
            "model.layers.1.router.per_expert_scale": (F, A),
            "model.layers.1.experts.gate_up_proj": (F, F),
            "model.layers.1.experts.down_proj": (F, F),
        },
    ),
}


@pytest.mark.parametrize(
    ("family", "name", "gate_on_attention", "owner"),
    [
        pytest.param(family, name, gate, owners[gate], id=f"{family}-{name}-{gate}")
        for family, (_, table) in TABLES.items()
        for name, owners in table.items()
        for gate in (False, True)
    ],
)
def test_weight_owner_matches_family_table(
    family: str, name: str, gate_on_attention: bool, owner: AFDRole
) -> None:
    prefixes = TABLES[family][0]
    got = weight_owner(name, prefixes, compute_gate_on_attention=gate_on_attention)
    assert got is owner


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.1.mlp_extra.weight",  # "mlp_extra" is not "mlp"
        "model.layers.0.mlpx.up_proj.weight",
        "model.layers.10.mlp.experts.0.up_proj.weight",  # layer 10, not 1
    ],
)
def test_weight_owner_prefixes_match_whole_components_only(name: str) -> None:
    prefixes = TABLES["deepseek"][0]
    assert weight_owner(name, prefixes, compute_gate_on_attention=False) is A


def test_weight_owner_gate_prefix_does_not_claim_gate_proj() -> None:
    prefixes = SplitPrefixes(
        moe_blocks=("model.layers.1.mlp",),
        gates=("model.layers.1.mlp.gate",),
        dense_mlps=(),
    )
    name = "model.layers.1.mlp.gate_proj.weight"  # inside the block, not the gate
    assert weight_owner(name, prefixes, compute_gate_on_attention=True) is F


@pytest.mark.parametrize(
    ("checkpoint", "owners"),
    [
        # Granite 4's loader renames these itself (its record's
        # ``checkpoint_renames``): the router goes where the gate runs, the
        # packed experts to the FFN, the shared MLP beside the block where
        # dense MLPs run, Mamba's parameters to attention
        ("model.layers.1.block_sparse_moe.router.layer.weight", (F, A)),
        ("model.layers.1.block_sparse_moe.input_linear.weight", (F, F)),
        ("model.layers.1.block_sparse_moe.output_linear.weight", (F, F)),
        ("model.layers.1.shared_mlp.input_linear.weight", (F, A)),
        ("model.layers.0.mamba.A_log", (A, A)),
    ],
)
def test_a_family_loader_s_own_renames_decide_ownership(
    checkpoint: str, owners: tuple[AFDRole, AFDRole]
) -> None:
    from vllm_afd.models.families import family_of

    family = family_of("GraniteMoeHybridForCausalLM")
    assert family is not None
    name = vllm_weight_name(checkpoint, None, family.checkpoint_renames)
    blocks = tuple(f"model.layers.{i}.block_sparse_moe" for i in range(3))
    prefixes = SplitPrefixes(
        moe_blocks=blocks,
        gates=tuple(f"{b}.gate" for b in blocks),
        dense_mlps=tuple(f"model.layers.{i}.shared_mlp" for i in range(3)),
        routed_experts=tuple(f"{b}.experts" for b in blocks),
    )
    for gate_on_attention, owner in zip((False, True), owners, strict=True):
        got = weight_owner(name, prefixes, compute_gate_on_attention=gate_on_attention)
        assert got is owner, (checkpoint, name, gate_on_attention)


def test_pangu_s_score_bias_stored_on_the_block_goes_where_the_gate_runs():
    """openPangu's checkpoints store the gate's score bias on the MoE block
    (``mlp.e_score_correction_bias``); its loader renames it in its own code
    (the record's ``checkpoint_renames``), so it is the gate's, not the
    block's (which would send it to the FFN role whatever the placement)."""
    from vllm_afd.models.families import family_of

    family = family_of("PanguUltraMoEForCausalLM")
    assert family is not None
    prefixes = _prefixes("mlp", dense=True)
    for checkpoint, owners in [
        ("model.layers.1.mlp.e_score_correction_bias", (F, A)),
        ("model.layers.1.mlp.gate.weight", (F, A)),
        ("model.layers.1.mlp.experts.3.up_proj.weight", (F, F)),
        ("model.layers.0.mlp.up_proj.weight", (F, A)),
    ]:
        name = vllm_weight_name(checkpoint, None, family.checkpoint_renames)
        for gate_on_attention, owner in zip((False, True), owners, strict=True):
            got = weight_owner(
                name, prefixes, compute_gate_on_attention=gate_on_attention
            )
            assert got is owner, (checkpoint, name, gate_on_attention)


def test_the_model_s_name_map_runs_first_and_a_dropped_name_stays():
    mapped = {"model.layers.1.mlp.router.weight": "model.layers.1.mlp.gate.weight"}
    assert (
        vllm_weight_name("model.layers.1.mlp.router.weight", mapped.get)
        == "model.layers.1.mlp.gate.weight"
    )
    assert vllm_weight_name("lm_head.weight", mapped.get) == "lm_head.weight"


def test_a_dense_mlp_built_under_another_prefix_is_named_as_the_model_holds_it():
    """Step-3 builds its decoder under the prefix "" (not ``model``): vLLM
    passes ``.layers.0.mlp`` for the module ``model.layers.0.mlp``, which the
    split's prefixes must name as it is (ownership, parameter groups)."""
    from torch import nn

    from vllm_afd.errors import AFDConfigError
    from vllm_afd.models.split import _built_names

    layer = nn.Module()
    layer.mlp = nn.Linear(2, 2)
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([layer])
    assert _built_names(model, ["model.layers.0.mlp"]) == ("model.layers.0.mlp",)
    assert _built_names(model, [".layers.0.mlp"]) == ("model.layers.0.mlp",)
    other = nn.Module()
    other.mlp = nn.Linear(2, 2)
    model.other = nn.Module()
    model.other.layers = nn.ModuleList([other])
    with pytest.raises(AFDConfigError, match="names 2 modules of the model"):
        _built_names(model, [".layers.0.mlp"])
