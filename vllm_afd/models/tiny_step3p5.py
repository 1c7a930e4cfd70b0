"""A tiny random-weight Step-3.5 checkpoint, written tensor by tensor.

transformers has no Step-3.5 classes: the config class is vLLM's own
(``model_type: step3p5``) and the weights follow the names vLLM's
``Step3p5ForCausalLM`` loads, in the release's packed expert layout::

    model.layers.N.moe.gate.weight           [E, H]      router (float32 GEMM)
    model.layers.N.moe.router_bias           [E]         score bias, held by the block
    model.layers.N.moe.{gate,up}_proj.weight [E, I, H]   all routed experts
    model.layers.N.moe.down_proj.weight      [E, H, I]
    model.layers.N.moe.share_expert.*        one shared expert

What the tiny model keeps of the release: layer 0 dense and the others MoE
(``moe_layers_enum``), sigmoid scores with a bias, a routed scaling factor, a
shared expert beside the routed ones, q/k norms, a per-head sigmoid gate on
the attention output (``g_proj``), and sliding-window layers with their own
head count (``attention_other_setting``) alternating with full ones. The
SwiGLU clamp (``swiglu_limits``) is left out.

Used by :func:`vllm_afd.models.tiny_checkpoint.write_tiny_checkpoint`.
"""

from __future__ import annotations

from typing import Any

#: heads of the full-attention layers and of the sliding ones
_HEADS, _SLIDING_HEADS, _KV_HEADS, _HEAD_DIM = 4, 8, 2, 32
_EXPERTS, _TOP_K = 8, 2


def step3p5_config(
    *,
    num_layers: int,
    vocab_size: int,
    hidden_size: int,
    dtype: str,
    special_ids: dict[str, int],
    max_positions: int,
) -> dict[str, Any]:
    """The ``config.json`` of a tiny Step-3.5 model (layer 0 dense)."""
    layer_types = [
        "full_attention" if i % 2 else "sliding_attention" for i in range(num_layers)
    ]
    return {
        "architectures": ["Step3p5ForCausalLM"],
        "model_type": "step3p5",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": _HEADS,
        "num_attention_groups": _KV_HEADS,
        "head_dim": _HEAD_DIM,
        "max_position_embeddings": max_positions,
        "max_seq_len": max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "use_moe": True,
        "moe_layers_enum": ",".join(str(i) for i in range(1, num_layers)),
        "moe_num_experts": _EXPERTS,
        "moe_top_k": _TOP_K,
        "moe_intermediate_size": hidden_size // 2,
        "share_expert_dim": hidden_size // 2,
        "norm_expert_weight": True,
        "moe_router_activation": "sigmoid",
        "moe_router_scaling_factor": 2.0,
        "use_moe_router_bias": True,
        "need_fp32_gate": True,
        "use_head_wise_attn_gate": True,
        "layer_types": layer_types,
        "sliding_window": 16,
        "attention_other_setting": {
            "attention_type": "sliding_attention",
            "num_attention_heads": _SLIDING_HEADS,
            "num_attention_groups": _KV_HEADS,
            "head_dim": _HEAD_DIM,
        },
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        **special_ids,
    }


def step3p5_weight_specs(
    config: dict[str, Any],
) -> dict[str, tuple[tuple[int, ...], str]]:
    """Map checkpoint tensor name -> (shape, init kind) of ``config``."""
    h = config["hidden_size"]
    vocab = config["vocab_size"]
    head_dim = config["head_dim"]
    kv = config["num_attention_groups"] * head_dim
    other = config["attention_other_setting"]
    moe_layers = {int(i) for i in config["moe_layers_enum"].split(",")}
    experts, inter = config["moe_num_experts"], config["moe_intermediate_size"]
    specs: dict[str, tuple[tuple[int, ...], str]] = {
        "model.embed_tokens.weight": ((vocab, h), "embed"),
        "model.norm.weight": ((h,), "norm"),
        "lm_head.weight": ((vocab, h), "lm_head"),
    }
    for i, kind in enumerate(config["layer_types"]):
        p = f"model.layers.{i}"
        heads = (
            other["num_attention_heads"]
            if kind == other["attention_type"]
            else config["num_attention_heads"]
        )
        a = f"{p}.self_attn"
        specs[f"{a}.q_proj.weight"] = ((heads * head_dim, h), "linear")
        specs[f"{a}.k_proj.weight"] = ((kv, h), "linear")
        specs[f"{a}.v_proj.weight"] = ((kv, h), "linear")
        specs[f"{a}.o_proj.weight"] = ((h, heads * head_dim), "linear")
        specs[f"{a}.g_proj.weight"] = ((heads, h), "linear")
        specs[f"{a}.q_norm.weight"] = ((head_dim,), "norm")
        specs[f"{a}.k_norm.weight"] = ((head_dim,), "norm")
        specs[f"{p}.input_layernorm.weight"] = ((h,), "norm")
        specs[f"{p}.post_attention_layernorm.weight"] = ((h,), "norm")
        if i not in moe_layers:
            specs.update(_mlp(f"{p}.mlp", h, config["intermediate_size"]))
            continue
        m = f"{p}.moe"
        specs[f"{m}.gate.weight"] = ((experts, h), "router")
        specs[f"{m}.router_bias"] = ((experts,), "bias")
        specs[f"{m}.gate_proj.weight"] = ((experts, inter, h), "linear")
        specs[f"{m}.up_proj.weight"] = ((experts, inter, h), "linear")
        specs[f"{m}.down_proj.weight"] = ((experts, h, inter), "linear")
        specs.update(_mlp(f"{m}.share_expert", h, config["share_expert_dim"]))
    return specs


def _mlp(
    prefix: str, hidden: int, inter: int
) -> dict[str, tuple[tuple[int, ...], str]]:
    return {
        f"{prefix}.gate_proj.weight": ((inter, hidden), "linear"),
        f"{prefix}.up_proj.weight": ((inter, hidden), "linear"),
        f"{prefix}.down_proj.weight": ((hidden, inter), "linear"),
    }
