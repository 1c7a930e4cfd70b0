"""Tiny random-weight checkpoints of the MoE families written by transformers.

Each family's ``config.json`` comes from transformers' own config class and its
weights from the transformers model class (``save_pretrained``), so the layout is
the one transformers writes for that family and vLLM loads. The values are drawn
again, per tensor name, by :func:`vllm_afd.models.tiny_checkpoint.draw` with the
same scales as the DeepSeek writer, so greedy decoding depends on the context and
the routers spread tokens over the experts.

Used by :func:`vllm_afd.models.tiny_checkpoint.write_tiny_checkpoint`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: family -> (transformers config class, its MoE keyword arguments)
_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # Dense layers where mlp_only_layers says; no shared experts.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            head_dim=32,
        ),
    ),
    # A shared expert with its own sigmoid gate; the router runs before the
    # MoE runner.
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            shared_expert_intermediate_size=128,
            qkv_bias=True,
        ),
    ),
    # Every layer MoE, no shared experts, router before the runner.
    "mixtral": (
        "MixtralConfig",
        dict(num_local_experts=8, num_experts_per_tok=2, head_dim=32),
    ),
    # First dense layers, shared experts, sigmoid grouped top-k with a
    # correction bias and a routed scaling factor, router before the runner.
    "glm4_moe": (
        "Glm4MoeConfig",
        dict(
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            use_qk_norm=True,
            head_dim=32,
            num_mtp_layers=0,
        ),
    ),
}

HF_ARCHS = tuple(_FAMILIES)


def hf_config(
    arch: str,
    *,
    num_layers: int,
    vocab_size: int,
    hidden_size: int,
    dtype: str,
    special_ids: dict[str, int],
    max_positions: int,
) -> Any:
    """The transformers config of a tiny ``arch`` model (layer 0 dense where
    the family has dense layers)."""
    import transformers

    class_name, moe = _FAMILIES[arch]
    config_cls = getattr(transformers, class_name)
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size // 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="silu",
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        dtype=dtype,
        **special_ids,
        **moe,
    )
    if arch in ("qwen3_moe", "qwen2_moe"):
        kwargs["mlp_only_layers"] = [0]
    if arch == "mixtral":
        kwargs.pop("moe_intermediate_size")
        kwargs["intermediate_size"] = hidden_size // 2
    if arch == "glm4_moe":
        kwargs["first_k_dense_replace"] = 1
    config = config_cls(**kwargs)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    return config


def write_hf_weights(
    config: Any,
    out: Path,
    draw: Any,
    seed: int,
    dtype: torch.dtype,
) -> None:
    """Build the transformers model of ``config``, draw every tensor again by
    name and save it as transformers saves that family."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(draw(seed, name, tuple(tensor.shape), _kind(name)))
    model.to(dtype).save_pretrained(out, safe_serialization=True)


def _kind(name: str) -> str:
    """How a tensor is initialised, from its transformers name."""
    if "embed_tokens" in name:
        return "embed"
    if name.startswith("lm_head"):
        return "lm_head"
    if "e_score_correction_bias" in name:
        return "bias"
    if name.endswith(".bias"):
        return "bias"
    if "norm" in name:
        return "norm"
    leaf = name.rsplit(".", 2)
    if leaf[-2] == "gate" and leaf[-1] == "weight":
        return "router"
    return "linear"
