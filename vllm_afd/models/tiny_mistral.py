"""Tiny random-weight Mistral Large 3 checkpoints, in the names of Mistral's
own release (``consolidated`` safetensors), which vLLM's
``MistralLarge3ForCausalLM`` maps onto DeepSeek-V3's modules itself.

**Config.** vLLM reads a Mistral Large 3 release's ``params.json`` into a
DeepSeek-V3 config (``model_type: deepseek_v3``, ``architectures:
[MistralLarge3ForCausalLM]``): MLA, a first dense layer, shared experts,
softmax scores over grouped top-k, renormalised, a routed scaling factor, no
score bias, and Llama 4's position-dependent query scaling
(``llama_4_scaling``). The ``config.json`` written here is that config, at
the tiny DeepSeek-V3's MLA dims (the CPU MLA's 512 + 64 latent); its
``llama_4_scaling`` starts at position 64, so the workload's prompts are
scaled.

**Weights**, as the release names them (no ``model.`` prefix)::

    tok_embeddings.weight, norm.weight, output.weight
    layers.N.attention_norm.weight, layers.N.ffn_norm.weight
    layers.N.attention.{wq_a,q_a_norm,wq_b,wkv_a_with_mqa,kv_a_norm,wkv_b,wo}.weight
    layers.N.feed_forward.{w1,w2,w3}.weight        dense layers
    layers.N.gate.weight                           router
    layers.N.experts.E.{w1,w2,w3}.weight           routed experts
    layers.N.shared_experts.{w1,w2,w3}.weight      shared experts

Used by :func:`vllm_afd.models.tiny_checkpoint.write_tiny_checkpoint`.
"""

from __future__ import annotations

import re
from typing import Any

#: (vLLM name pattern, release name) of every tensor, the inverse of vLLM's
#: ``MistralLarge3ForCausalLM.hf_to_vllm_mapper``
_RELEASE_NAMES = (
    (r"model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.attention_norm."),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.ffn_norm."),
    (r"model\.layers\.(\d+)\.self_attn\.q_a_proj\.", r"layers.\1.attention.wq_a."),
    (
        r"model\.layers\.(\d+)\.self_attn\.q_a_layernorm\.",
        r"layers.\1.attention.q_a_norm.",
    ),
    (r"model\.layers\.(\d+)\.self_attn\.q_b_proj\.", r"layers.\1.attention.wq_b."),
    (
        r"model\.layers\.(\d+)\.self_attn\.kv_a_proj_with_mqa\.",
        r"layers.\1.attention.wkv_a_with_mqa.",
    ),
    (
        r"model\.layers\.(\d+)\.self_attn\.kv_a_layernorm\.",
        r"layers.\1.attention.kv_a_norm.",
    ),
    (r"model\.layers\.(\d+)\.self_attn\.kv_b_proj\.", r"layers.\1.attention.wkv_b."),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.", r"layers.\1.attention.wo."),
    (r"model\.layers\.(\d+)\.mlp\.gate\.", r"layers.\1.gate."),
    (
        r"model\.layers\.(\d+)\.mlp\.(experts\.\d+|shared_experts)\.gate_proj\.",
        r"layers.\1.\2.w1.",
    ),
    (
        r"model\.layers\.(\d+)\.mlp\.(experts\.\d+|shared_experts)\.down_proj\.",
        r"layers.\1.\2.w2.",
    ),
    (
        r"model\.layers\.(\d+)\.mlp\.(experts\.\d+|shared_experts)\.up_proj\.",
        r"layers.\1.\2.w3.",
    ),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.", r"layers.\1.feed_forward.w1."),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.", r"layers.\1.feed_forward.w2."),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.", r"layers.\1.feed_forward.w3."),
    (r"model\.norm\.", "norm."),
    (r"model\.embed_tokens\.", "tok_embeddings."),
    (r"lm_head\.", "output."),
)


def release_name(name: str) -> str:
    """The release's name of the tensor vLLM calls ``name``."""
    for pattern, release in _RELEASE_NAMES:
        renamed, hits = re.subn(rf"\A{pattern}", release, name)
        if hits:
            return renamed
    raise ValueError(f"no Mistral Large 3 release name for {name!r}")


def mistral_large_3_config(
    *,
    num_layers: int,
    vocab_size: int,
    hidden_size: int,
    dtype: str,
    special_ids: dict[str, int],
    max_positions: int,
) -> dict[str, Any]:
    """The ``config.json`` of a tiny Mistral Large 3 model (layer 0 dense),
    as vLLM reads a release's ``params.json``."""
    from vllm_afd.models.tiny_checkpoint import tiny_config

    config = tiny_config(
        "deepseek_v3",
        num_layers=num_layers,
        vocab_size=vocab_size,
        dtype=dtype,
        hidden_size=hidden_size,
    )
    del config["rope_interleave"]
    config.update(
        architectures=["MistralLarge3ForCausalLM"],
        max_position_embeddings=max_positions,
        # vLLM's reader of the release's params.json sets these
        topk_method=None,
        scoring_func="softmax",
        norm_topk_prob=True,
        llama_4_scaling={"original_max_position_embeddings": 64, "beta": 0.1},
        **special_ids,
    )
    return dict(sorted(config.items()))


def mistral_large_3_weight_specs(
    config: dict[str, Any],
) -> dict[str, tuple[tuple[int, ...], str]]:
    """Map release tensor name -> (shape, init kind) of ``config``."""
    from vllm_afd.models.tiny_checkpoint import _weight_specs

    return {release_name(n): spec for n, spec in _weight_specs(config).items()}
