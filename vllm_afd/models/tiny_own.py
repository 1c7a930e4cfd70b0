"""Tiny random-weight checkpoints written tensor by tensor, in the names
vLLM loads: families transformers has no classes for (Step-3.5, Step-3), or whose
transformers layout vLLM's module does not load (HY-V3); Mistral Large 3, in
its release's names, is written by :mod:`vllm_afd.models.tiny_mistral`.

**Step-3.5.** The config class is vLLM's own (``model_type: step3p5``) and
the weights follow the names vLLM's ``Step3p5ForCausalLM`` loads, in the
release's packed expert layout::

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

**Step-3** (text). The config class is vLLM's own (``model_type:
step3_text``); the routed experts are packed per layer as for Step-3.5 (no
score bias), each MoE layer's shared expert lies beside the MoE block::

    model.layers.N.moe.gate.weight           [E, H]      router
    model.layers.N.moe.{gate,up}_proj.weight [E, I, H]   all routed experts
    model.layers.N.moe.down_proj.weight      [E, H, I]
    model.layers.N.share_expert.*            the shared expert, beside the block
    model.layers.N.self_attn.{q_proj,k_proj,v_proj,inter_norm,wq,o_proj}.weight

The tiny model keeps layer 0 dense (``moe_layers_enum``), softmax top-k not
renormalised, one KV head and the queries' low-rank projection with its
norm.

**HY-V3** (Hunyuan 3). transformers' ``HYV3Config`` writes the layout, plus
the keys vLLM's module reads that it does not write (``expert_hidden_dim``,
``route_norm``, ``first_k_dense_replace``, ``qk_norm``); the weights are in
the release's names, one tensor per expert (transformers' own model packs
the experts and renames the shared expert and the score bias, which vLLM's
loader does not map)::

    model.layers.N.mlp.gate.weight                  [E, H]  router (float32)
    model.layers.N.mlp.expert_bias                  [E]     score bias
    model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight
    model.layers.N.mlp.shared_mlp.{gate,up,down}_proj.weight

**DBRX.** transformers' ``DbrxConfig`` writes the config (its attention
config with the ``rope_theta`` vLLM reads, which transformers' own model
class lacks, so that class cannot build it); the weights are in the release's
names, all experts of a layer in one tensor per projection::

    transformer.blocks.N.norm_attn_norm.{norm_1,norm_2}.weight   LayerNorms (no bias)
    transformer.blocks.N.norm_attn_norm.attn.{Wqkv,out_proj}.weight
    transformer.blocks.N.ffn.router.layer.weight                 [E, H]  router
    transformer.blocks.N.ffn.experts.mlp.{w1,v1,w2}              [E * I, H]

The tiny model keeps DBRX's clipped QKV (``clip_qkv``), its LayerNorms
without bias, softmax top-k renormalised, and every layer MoE.

Used by :func:`vllm_afd.models.tiny_checkpoint.write_tiny_checkpoint`.
"""

from __future__ import annotations

from typing import Any

from vllm_afd.models.tiny_mistral import (
    mistral_large_3_config,
    mistral_large_3_weight_specs,
)

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
            specs.update(mlp_specs(f"{p}.mlp", h, config["intermediate_size"]))
            continue
        m = f"{p}.moe"
        specs[f"{m}.gate.weight"] = ((experts, h), "router")
        specs[f"{m}.router_bias"] = ((experts,), "bias")
        specs[f"{m}.gate_proj.weight"] = ((experts, inter, h), "linear")
        specs[f"{m}.up_proj.weight"] = ((experts, inter, h), "linear")
        specs[f"{m}.down_proj.weight"] = ((experts, h, inter), "linear")
        specs.update(mlp_specs(f"{m}.share_expert", h, config["share_expert_dim"]))
    return specs


def step3_text_config(
    *,
    num_layers: int,
    vocab_size: int,
    hidden_size: int,
    dtype: str,
    special_ids: dict[str, int],
    max_positions: int,
) -> dict[str, Any]:
    """The ``config.json`` of a tiny Step-3 text model (layer 0 dense), in
    the keys of vLLM's own ``Step3TextConfig``."""
    return {
        "architectures": ["Step3TextForCausalLM"],
        "model_type": "step3_text",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": _HEADS,
        "num_attention_groups": 1,
        "head_dim": _HEAD_DIM,
        # the queries' low-rank width, normed before their up-projection
        "share_q_dim": 2 * _HEAD_DIM,
        "max_position_embedding": max_positions,
        "max_seq_len": max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "moe_layers_enum": ",".join(str(i) for i in range(1, num_layers)),
        "moe_num_experts": _EXPERTS,
        "moe_top_k": _TOP_K,
        "moe_intermediate_size": hidden_size // 2,
        "share_expert_dim": hidden_size // 2,
        "norm_expert_weight": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        **special_ids,
    }


def step3_text_weight_specs(
    config: dict[str, Any],
) -> dict[str, tuple[tuple[int, ...], str]]:
    """Map checkpoint tensor name -> (shape, init kind) of ``config``."""
    h, vocab, head_dim = config["hidden_size"], config["vocab_size"], config["head_dim"]
    q_dim, heads = config["share_q_dim"], config["num_attention_heads"]
    moe_layers = {int(i) for i in config["moe_layers_enum"].split(",")}
    experts, inter = config["moe_num_experts"], config["moe_intermediate_size"]
    specs: dict[str, tuple[tuple[int, ...], str]] = {
        "model.embed_tokens.weight": ((vocab, h), "embed"),
        "model.norm.weight": ((h,), "norm"),
        "lm_head.weight": ((vocab, h), "lm_head"),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        specs[f"{a}.q_proj.weight"] = ((q_dim, h), "linear")
        specs[f"{a}.k_proj.weight"] = ((head_dim, h), "linear")
        specs[f"{a}.v_proj.weight"] = ((head_dim, h), "linear")
        specs[f"{a}.inter_norm.weight"] = ((q_dim,), "norm")
        specs[f"{a}.wq.weight"] = ((heads * head_dim, q_dim), "linear")
        specs[f"{a}.o_proj.weight"] = ((h, heads * head_dim), "linear")
        specs[f"{p}.input_layernorm.weight"] = ((h,), "norm")
        specs[f"{p}.post_attention_layernorm.weight"] = ((h,), "norm")
        if i not in moe_layers:
            specs.update(mlp_specs(f"{p}.mlp", h, config["intermediate_size"]))
            continue
        m = f"{p}.moe"
        specs[f"{m}.gate.weight"] = ((experts, h), "router")
        specs[f"{m}.gate_proj.weight"] = ((experts, inter, h), "linear")
        specs[f"{m}.up_proj.weight"] = ((experts, inter, h), "linear")
        specs[f"{m}.down_proj.weight"] = ((experts, h, inter), "linear")
        specs.update(mlp_specs(f"{p}.share_expert", h, config["share_expert_dim"]))
    return specs


def hy_v3_config(
    *,
    num_layers: int,
    vocab_size: int,
    hidden_size: int,
    dtype: str,
    special_ids: dict[str, int],
    max_positions: int,
) -> dict[str, Any]:
    """The ``config.json`` of a tiny HY-V3 model (layer 0 dense)."""
    import transformers

    config = transformers.HYV3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size // 2,
        num_hidden_layers=num_layers,
        num_attention_heads=_HEADS,
        num_key_value_heads=_KV_HEADS,
        head_dim=_HEAD_DIM,
        num_experts=_EXPERTS,
        num_experts_per_tok=_TOP_K,
        num_shared_experts=1,
        router_scaling_factor=2.0,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        mlp_layer_types=["dense"] + ["sparse"] * (num_layers - 1),
        tie_word_embeddings=False,
        dtype=dtype,
        **special_ids,
    ).to_dict()
    config.update(
        architectures=["HYV3ForCausalLM"],
        expert_hidden_dim=hidden_size // 2,
        route_norm=True,
        first_k_dense_replace=1,
        qk_norm=True,
    )
    return config


def hy_v3_weight_specs(
    config: dict[str, Any],
) -> dict[str, tuple[tuple[int, ...], str]]:
    """Map checkpoint tensor name -> (shape, init kind) of ``config``."""
    h, vocab, head_dim = config["hidden_size"], config["vocab_size"], config["head_dim"]
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    experts, inter = config["num_experts"], config["expert_hidden_dim"]
    specs: dict[str, tuple[tuple[int, ...], str]] = {
        "model.embed_tokens.weight": ((vocab, h), "embed"),
        "model.norm.weight": ((h,), "norm"),
        "lm_head.weight": ((vocab, h), "lm_head"),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        specs[f"{a}.q_proj.weight"] = ((q, h), "linear")
        specs[f"{a}.k_proj.weight"] = ((kv, h), "linear")
        specs[f"{a}.v_proj.weight"] = ((kv, h), "linear")
        specs[f"{a}.o_proj.weight"] = ((h, q), "linear")
        specs[f"{a}.q_norm.weight"] = ((head_dim,), "norm")
        specs[f"{a}.k_norm.weight"] = ((head_dim,), "norm")
        specs[f"{p}.input_layernorm.weight"] = ((h,), "norm")
        specs[f"{p}.post_attention_layernorm.weight"] = ((h,), "norm")
        m = f"{p}.mlp"
        if i < config["first_k_dense_replace"]:
            specs.update(mlp_specs(m, h, config["intermediate_size"]))
            continue
        specs[f"{m}.gate.weight"] = ((experts, h), "router")
        specs[f"{m}.expert_bias"] = ((experts,), "bias")
        for e in range(experts):
            specs.update(mlp_specs(f"{m}.experts.{e}", h, inter))
        shared = inter * config["num_shared_experts"]
        specs.update(mlp_specs(f"{m}.shared_mlp", h, shared))
    return specs


def dbrx_config(
    *,
    num_layers: int,
    vocab_size: int,
    hidden_size: int,
    dtype: str,
    special_ids: dict[str, int],
    max_positions: int,
) -> dict[str, Any]:
    """The ``config.json`` of a tiny DBRX model (every layer MoE)."""
    import transformers

    attn = {"kv_n_heads": _KV_HEADS, "clip_qkv": 8.0, "rope_theta": 10000.0}
    ffn = {
        "ffn_act_fn": {"name": "silu"},
        "ffn_hidden_size": hidden_size // 2,
        "moe_num_experts": _EXPERTS,
        "moe_top_k": _TOP_K,
        "moe_normalize_expert_weights": 1.0,
    }
    config = transformers.DbrxConfig(
        d_model=hidden_size,
        n_heads=_HEADS,
        n_layers=num_layers,
        max_seq_len=max_positions,
        vocab_size=vocab_size,
        attn_config=attn,
        ffn_config=ffn,
        tie_word_embeddings=False,
        dtype=dtype,
        **special_ids,
    ).to_dict()
    # the sub-configs as the release writes them: transformers' own add
    # bookkeeping keys vLLM refuses, and drop ``rope_theta``, which it reads
    config.update(architectures=["DbrxForCausalLM"], attn_config=attn, ffn_config=ffn)
    return config


def dbrx_weight_specs(
    config: dict[str, Any],
) -> dict[str, tuple[tuple[int, ...], str]]:
    """Map checkpoint tensor name -> (shape, init kind) of ``config``."""
    h, vocab = config["d_model"], config["vocab_size"]
    head_dim = h // config["n_heads"]
    kv = config["attn_config"]["kv_n_heads"] * head_dim
    ffn = config["ffn_config"]
    experts, inter = ffn["moe_num_experts"], ffn["ffn_hidden_size"]
    specs: dict[str, tuple[tuple[int, ...], str]] = {
        "transformer.wte.weight": ((vocab, h), "embed"),
        "transformer.norm_f.weight": ((h,), "norm"),
        "lm_head.weight": ((vocab, h), "lm_head"),
    }
    for i in range(config["n_layers"]):
        p = f"transformer.blocks.{i}"
        n = f"{p}.norm_attn_norm"
        specs[f"{n}.norm_1.weight"] = ((h,), "norm")
        specs[f"{n}.norm_2.weight"] = ((h,), "norm")
        specs[f"{n}.attn.Wqkv.weight"] = ((h + 2 * kv, h), "linear")
        specs[f"{n}.attn.out_proj.weight"] = ((h, h), "linear")
        specs[f"{p}.ffn.router.layer.weight"] = ((experts, h), "router")
        # w2 too is [E * I, H]: each expert's down projection transposed
        for w in ("w1", "v1", "w2"):
            specs[f"{p}.ffn.experts.mlp.{w}"] = ((experts * inter, h), "linear")
    return specs


#: family -> (config writer, weight specs) of the checkpoints written here
OWN_WRITERS = {
    "step3p5": (step3p5_config, step3p5_weight_specs),
    "step3_text": (step3_text_config, step3_text_weight_specs),
    "hy_v3": (hy_v3_config, hy_v3_weight_specs),
    "mistral_large_3": (mistral_large_3_config, mistral_large_3_weight_specs),
    "dbrx": (dbrx_config, dbrx_weight_specs),
}


def mlp_specs(
    prefix: str, hidden: int, inter: int
) -> dict[str, tuple[tuple[int, ...], str]]:
    """The three projections of a gated MLP (an expert, a dense or shared
    MLP) under ``prefix``."""
    return {
        f"{prefix}.gate_proj.weight": ((inter, hidden), "linear"),
        f"{prefix}.up_proj.weight": ((inter, hidden), "linear"),
        f"{prefix}.down_proj.weight": ((hidden, inter), "linear"),
    }


def mla_specs(
    prefix: str, config: dict[str, Any]
) -> dict[str, tuple[tuple[int, ...], str]]:
    """The multi-head latent attention under ``prefix`` in DeepSeek-V3's
    names: the queries projected directly (``q_lora_rank`` None) or through
    a latent of ``q_lora_rank``, the KV latent with its norm, the output."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    nope, rope = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
    v, kv_rank, q_rank = (
        config["v_head_dim"],
        config["kv_lora_rank"],
        config["q_lora_rank"],
    )
    queries: dict[str, tuple[tuple[int, ...], str]]
    if q_rank is None:
        queries = {f"{prefix}.q_proj.weight": ((heads * (nope + rope), h), "linear")}
    else:
        queries = {
            f"{prefix}.q_a_proj.weight": ((q_rank, h), "linear"),
            f"{prefix}.q_a_layernorm.weight": ((q_rank,), "norm"),
            f"{prefix}.q_b_proj.weight": ((heads * (nope + rope), q_rank), "linear"),
        }
    return {
        **queries,
        f"{prefix}.kv_a_proj_with_mqa.weight": ((kv_rank + rope, h), "linear"),
        f"{prefix}.kv_a_layernorm.weight": ((kv_rank,), "norm"),
        f"{prefix}.kv_b_proj.weight": ((heads * (nope + v), kv_rank), "linear"),
        f"{prefix}.o_proj.weight": ((h, heads * v), "linear"),
    }
