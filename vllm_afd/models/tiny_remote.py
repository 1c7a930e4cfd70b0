"""Tiny random-weight checkpoints of families whose releases ship their config
class as code of their own (``auto_map``), which transformers does not have:
Ling (``BailingMoeForCausalLM``), Ling 2.0 (``BailingMoeV2ForCausalLM``),
DeepSeek-MoE (``DeepseekForCausalLM``, ``model_type: deepseek``), Sarvam-MoE
(``SarvamMoEForCausalLM``), Sarvam-MLA (``SarvamMLAForCausalLM``), Param2
(``Param2MoEForCausalLM``), Pangu Ultra MoE (``PanguUltraMoEForCausalLM``) and
openPangu Embedded with MoE layers (``PanguEmbeddedForCausalLM``).

Each checkpoint carries, as the releases do, a ``configuration_*.py`` that
``config.json``'s ``auto_map`` names (a plain ``PretrainedConfig`` holding
the keys), so vLLM loads it with ``--trust-remote-code``; ``config.json``
holds the keys vLLM's module reads. The weights are in the releases' names,
one tensor per routed expert::

    Ling, Ling 2.0 (vLLM's ``bailing_moe``), Sarvam-MoE (Ling's classes), Param2
    model.word_embeddings.weight, model.norm.weight, lm_head.weight
    model.layers.N.attention.query_key_value.weight    fused q, k, v
    model.layers.N.attention.dense.weight              output projection
    model.layers.N.attention.{query,key}_layernorm.weight   Ling 2.0's q/k norms
    model.layers.N.mlp.{gate,up,down}_proj.weight      dense layers (Ling 2.0: 0)
    model.layers.N.mlp.gate.weight                     router
    model.layers.N.mlp.gate.expert_bias                score bias (not Ling's)
    model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight
    model.layers.N.mlp.shared_experts.{gate,up,down}_proj.weight

    DeepSeek-MoE (vLLM's ``deepseek_v2``, multi-head attention)
    model.layers.N.self_attn.{q,k,v,o}_proj.weight
    model.layers.N.mlp.gate.weight, mlp.experts.E.*, mlp.shared_experts.*

    Sarvam-MLA (vLLM's ``sarvam``: DeepSeek-V3's names)
    model.embed_tokens.weight
    model.layers.N.self_attn.{q_proj,kv_b_proj,o_proj}.weight
    model.layers.N.self_attn.{kv_a_proj_with_mqa,kv_a_layernorm}.weight
    model.layers.N.mlp.gate.weight, mlp.gate.e_score_correction_bias
    model.layers.N.mlp.experts.E.*, mlp.shared_experts.*

    Pangu Ultra MoE (vLLM's ``openpangu``: DeepSeek-V3's names)
    model.layers.N.self_attn.{q_a_proj,q_a_layernorm,q_b_proj,...}.weight
    model.layers.N.{pre,post}_mlp_layernorm.weight     sandwich norms
    model.layers.N.mlp.e_score_correction_bias          the gate's, on the block

    openPangu Embedded (vLLM's ``openpangu``): Pangu Ultra MoE's MLP names
    model.layers.N.self_attn.{q,k,v,o}_proj.{weight,bias}  grouped-query

What the tiny models keep: Ling: every layer MoE, softmax top-k
renormalised, two shared experts, the lm_head normalised on load
(``norm_head``). Ling 2.0: layer 0 dense, q/k RMS norms, partial rotary,
sigmoid scores with a bias on the gate over grouped top-k, routed scaling, a
shared expert, an fp32 router. DeepSeek-MoE: layer 0 dense, softmax top-k
not renormalised, two shared experts. Sarvam-MoE: Ling 2.0's, top-k over one
group, full rotary. Sarvam-MLA: layer 0 dense, MLA with queries projected
directly and ``head_dim`` the latent cache's width (as the release's config
class sets it: vLLM sizes the cache by it), sigmoid grouped top-k with a
score bias (which vLLM's loader shifts to zero mean), routed scaling, a
shared expert, an fp32 router. Param2: Ling 2.0's, its score bias shifted
to zero mean by vLLM's loader. Pangu Ultra MoE: layer 0 dense, MLA with a
query latent, sigmoid top-k with a score bias, the routed scaling applied to
the MoE output, a shared expert, norms before and after each MLP.
openPangu Embedded: Pangu Ultra MoE's MoE layers (its releases are dense;
vLLM's module builds that block where the config has ``n_routed_experts``)
after a first dense layer, grouped-query attention with q, k, v and output
biases, no sandwich norms.

Used by :mod:`vllm_afd.models.tiny_hf` (``hf_config`` / ``write_hf_weights``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_HEADS, _KV_HEADS, _HEAD_DIM = 4, 2, 32

#: family -> (model_type, architecture, config class, MoE keys)
REMOTE_FAMILIES: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    # Ling (1.x): every layer MoE, softmax top-k, two shared experts
    "bailing_moe": (
        "bailing_moe",
        "BailingMoeForCausalLM",
        "BailingMoeConfig",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            num_shared_experts=2,
            norm_topk_prob=True,
            first_k_dense_replace=0,
            norm_head=True,
        ),
    ),
    # Ling 2.0: a first dense layer, sigmoid grouped top-k with a bias held
    # by the gate, routed scaling, q/k RMS norms, partial rotary
    "bailing_moe_v2": (
        "bailing_moe",
        "BailingMoeV2ForCausalLM",
        "BailingMoeV2Config",
        dict(
            num_experts=16,
            num_experts_per_tok=4,
            num_shared_experts=1,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            router_dtype="fp32",
            use_qk_norm=True,
            use_rmsnorm=True,
            partial_rotary_factor=0.5,
        ),
    ),
    # DeepSeek-MoE: multi-head attention, a first dense layer, softmax top-k
    # not renormalised, two shared experts
    "deepseek_moe": (
        "deepseek",
        "DeepseekForCausalLM",
        "DeepseekConfig",
        dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=2,
            norm_topk_prob=False,
            first_k_dense_replace=1,
            moe_layer_freq=1,
            scoring_func="softmax",
            topk_method="greedy",
        ),
    ),
    # Sarvam-MoE: Ling 2.0's layout (vLLM builds it with a subclass of
    # Ling's class): a first dense layer, sigmoid top-k over one group with a
    # bias held by the gate, routed scaling, q/k RMS norms, an fp32 router
    "sarvam_moe": (
        "sarvam_moe",
        "SarvamMoEForCausalLM",
        "SarvamMoEConfig",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            num_shared_experts=1,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            router_dtype="fp32",
            use_qk_norm=True,
            use_rmsnorm=True,
        ),
    ),
    # Param2-MoE: Ling's weight names in a module of its own: a first dense
    # layer, q/k RMS norms, partial rotary, an fp32 gate, sigmoid grouped
    # top-k with a bias held by the gate (which vLLM's loader shifts to zero
    # mean), routed scaling, a shared expert
    "param2moe": (
        "param2moe",
        "Param2MoEForCausalLM",
        "Param2MoEConfig",
        dict(
            num_experts=16,
            num_experts_per_tok=4,
            num_shared_experts=1,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            use_qk_norm=True,
            partial_rotary_factor=0.5,
            # vLLM's module reads it, as the release's config class writes it
            rope_scaling=None,
        ),
    ),
    # Pangu Ultra MoE (openPangu): DeepSeek-V3's layout in a module of its own:
    # MLA with a query latent, a first dense layer, sigmoid top-k with a
    # score bias the checkpoint stores on the MoE block, the routed scaling
    # applied to the MoE output, shared experts, norms around each MLP
    # (``sandwich_norm``)
    "pangu_ultra_moe": (
        "pangu_ultra_moe",
        "PanguUltraMoEForCausalLM",
        "PanguUltraMoEConfig",
        dict(
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_shared_experts=1,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            router_enable_expert_bias=True,
            routed_scaling_factor=2.5,
            sandwich_norm=True,
            num_nextn_predict_layers=0,
            # vLLM's CPU MLA takes kv_lora_rank + qk_rope_head_dim = 576 only
            kv_lora_rank=512,
            q_lora_rank=64,
            qk_rope_head_dim=64,
            qk_nope_head_dim=32,
            v_head_dim=32,
        ),
    ),
    # openPangu Embedded with MoE layers: vLLM's module builds an MoE block
    # (Pangu Ultra MoE's) where the config has ``n_routed_experts`` (the
    # released checkpoints are dense); grouped-query attention with q, k, v
    # and output biases (``bias``, as its release's config class sets it)
    "pangu_embedded": (
        "PanguEmbedded",
        "PanguEmbeddedForCausalLM",
        "PanguEmbeddedConfig",
        dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            router_enable_expert_bias=True,
            routed_scaling_factor=2.5,
            bias=True,
        ),
    ),
    # Sarvam-MLA: DeepSeek-V3's layout in a module of its own: MLA, a first
    # dense layer, sigmoid grouped top-k with a score bias that vLLM's loader
    # shifts to zero mean, routed scaling, a shared expert, an fp32 router
    "sarvam_mla": (
        "sarvam_mla",
        "SarvamMLAForCausalLM",
        "SarvamMLAConfig",
        dict(
            num_experts=16,
            num_experts_per_tok=4,
            num_shared_experts=1,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            moe_layer_freq=1,
            score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            router_dtype="fp32",
            # vLLM's CPU MLA takes kv_lora_rank + qk_rope_head_dim = 576 only;
            # queries projected directly, as in the release (vLLM's module
            # builds no fused q/kv projection for a q_lora_rank)
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=32,
            v_head_dim=32,
        ),
    ),
}

_CONFIG_CODE = '''\
"""{arch}'s configuration: the keys of config.json, as attributes."""

from transformers import PretrainedConfig


class {cls}(PretrainedConfig):
    model_type = "{model_type}"
'''


@dataclass(frozen=True)
class RemoteCodeConfig:
    """A tiny checkpoint's ``config.json`` (``values``) and the family's
    config module it names."""

    family: str
    values: dict[str, Any]

    @property
    def model_type(self) -> str:
        return self.values["model_type"]

    @property
    def module(self) -> str:
        return "configuration_" + self.family


def remote_config(
    family: str,
    moe: dict[str, Any],
    *,
    num_layers: int,
    vocab_size: int,
    hidden_size: int,
    dtype: str,
    special_ids: dict[str, int],
    max_positions: int,
) -> RemoteCodeConfig:
    """The config of a tiny ``family`` model, ``moe`` its MoE keys."""
    model_type, arch, cls, _ = REMOTE_FAMILIES[family]
    values: dict[str, Any] = dict(
        architectures=[arch],
        auto_map={"AutoConfig": f"configuration_{family}.{cls}"},
        model_type=model_type,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size // 2,
        num_hidden_layers=num_layers,
        num_attention_heads=_HEADS,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
        tie_word_embeddings=False,
        torch_dtype=dtype,
        **special_ids,
        **moe,
    )
    if model_type == "deepseek":
        # multi-head attention of hidden / heads wide heads
        values.update(num_key_value_heads=_HEADS, attention_bias=False)
    elif model_type == "sarvam_mla":
        # the release's config class sets head_dim to the latent cache's
        # width, which vLLM sizes the cache by (it takes ``sarvam_mla`` for
        # no MLA model type of its own)
        values.update(
            num_key_value_heads=_HEADS,
            head_dim=values["kv_lora_rank"] + values["qk_rope_head_dim"],
            embedding_dropout=0.0,
        )
    elif _mla(values):
        values.update(num_key_value_heads=_HEADS, attention_bias=False)
    elif model_type == "PanguEmbedded":
        values.update(num_key_value_heads=_KV_HEADS, head_dim=_HEAD_DIM)
    else:
        values.update(
            num_key_value_heads=_KV_HEADS,
            head_dim=_HEAD_DIM,
            use_bias=False,
            use_qkv_bias=False,
            embedding_dropout=0.0,
        )
    return RemoteCodeConfig(family, dict(sorted(values.items())))


def _mla(values: dict[str, Any]) -> bool:
    """Whether the family's attention is multi-head latent (Sarvam-MLA,
    Pangu Ultra MoE)."""
    return "kv_lora_rank" in values


def _gqa_specs(a: str, h: int, *, bias: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """Grouped-query attention under ``a`` in Llama's names, with a bias on
    every projection where ``bias`` (openPangu Embedded)."""
    q, kv = _HEADS * _HEAD_DIM, _KV_HEADS * _HEAD_DIM
    specs: dict[str, tuple[tuple[int, ...], str]] = {}
    for proj, (rows, cols) in {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
    }.items():
        specs[f"{a}.{proj}.weight"] = ((rows, cols), "linear")
        if bias:
            specs[f"{a}.{proj}.bias"] = ((rows,), "bias")
    return specs


def weight_specs(config: RemoteCodeConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Map checkpoint tensor name -> (shape, init kind) of ``config``."""
    from vllm_afd.models.tiny_own import mla_specs, mlp_specs

    c = config.values
    h, vocab = c["hidden_size"], c["vocab_size"]
    deepseek = c["model_type"] == "deepseek"
    pangu_gqa = c["model_type"] == "PanguEmbedded"
    mla = _mla(c)
    experts: int = c["n_routed_experts" if "n_routed_experts" in c else "num_experts"]
    shared: int = c[
        "n_shared_experts" if "n_shared_experts" in c else "num_shared_experts"
    ]
    inter = c["moe_intermediate_size"]
    own_names = deepseek or mla or pangu_gqa  # DeepSeek's names, not Ling's
    embed = "model.embed_tokens.weight" if own_names else "model.word_embeddings.weight"
    # the score bias: held by the gate in Ling's name or DeepSeek-V3's
    # (Sarvam-MLA); Pangu's checkpoints store it on the MoE block
    bias = {
        "pangu_ultra_moe": "e_score_correction_bias",
        "PanguEmbedded": "e_score_correction_bias",
        "sarvam_mla": "gate.e_score_correction_bias",
    }.get(c["model_type"], "gate.expert_bias")
    has_bias = c.get("moe_router_enable_expert_bias") or c.get(
        "router_enable_expert_bias"
    )
    specs: dict[str, tuple[tuple[int, ...], str]] = {
        embed: ((vocab, h), "embed"),
        "model.norm.weight": ((h,), "norm"),
        "lm_head.weight": ((vocab, h), "lm_head"),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        specs[f"{p}.input_layernorm.weight"] = ((h,), "norm")
        specs[f"{p}.post_attention_layernorm.weight"] = ((h,), "norm")
        if c.get("sandwich_norm"):
            specs[f"{p}.pre_mlp_layernorm.weight"] = ((h,), "norm")
            specs[f"{p}.post_mlp_layernorm.weight"] = ((h,), "norm")
        if deepseek:
            a = f"{p}.self_attn"
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                specs[f"{a}.{proj}.weight"] = ((h, h), "linear")
        elif mla:
            specs.update(mla_specs(f"{p}.self_attn", c))
        elif pangu_gqa:
            specs.update(_gqa_specs(f"{p}.self_attn", h, bias=c["bias"]))
        else:
            a = f"{p}.attention"
            q, kv = _HEADS * _HEAD_DIM, _KV_HEADS * _HEAD_DIM
            specs[f"{a}.query_key_value.weight"] = ((q + 2 * kv, h), "linear")
            specs[f"{a}.dense.weight"] = ((h, q), "linear")
            if c.get("use_qk_norm"):
                specs[f"{a}.query_layernorm.weight"] = ((_HEAD_DIM,), "norm")
                specs[f"{a}.key_layernorm.weight"] = ((_HEAD_DIM,), "norm")
        m = f"{p}.mlp"
        if i < c["first_k_dense_replace"]:
            specs.update(mlp_specs(m, h, c["intermediate_size"]))
            continue
        specs[f"{m}.gate.weight"] = ((experts, h), "router")
        if has_bias:
            specs[f"{m}.{bias}"] = ((experts,), "bias")
        for e in range(experts):
            specs.update(mlp_specs(f"{m}.experts.{e}", h, inter))
        specs.update(mlp_specs(f"{m}.shared_experts", h, inter * shared))
    return specs


def write_remote(
    config: RemoteCodeConfig, out: Path, draw: Any, seed: int, dtype: torch.dtype
) -> None:
    """Write ``config.json``, the config module it names and the weights."""
    from vllm_afd.models.tiny_checkpoint import _save_safetensors

    model_type, arch, cls, _ = REMOTE_FAMILIES[config.family]
    (out / "config.json").write_text(json.dumps(config.values, indent=2) + "\n")
    code = _CONFIG_CODE.format(arch=arch, cls=cls, model_type=model_type)
    (out / f"{config.module}.py").write_text(code)
    tensors = {
        name: draw(seed, name, shape, kind).to(dtype)
        for name, (shape, kind) in weight_specs(config).items()
    }
    _save_safetensors(tensors, out / "model.safetensors")
