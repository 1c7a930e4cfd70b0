"""Tiny random-weight checkpoints of the MoE families written by transformers.

Each family's ``config.json`` comes from transformers' own config class and its
weights from the transformers model class (``save_pretrained``), so the layout is
the one transformers writes for that family and vLLM loads. The values are drawn
again, per tensor name, by :func:`vllm_afd.models.tiny_checkpoint.draw` with the
same scales as the DeepSeek writer, so greedy decoding depends on the context and
the routers spread tokens over the experts. Families whose releases ship their
config class as code of their own (Ling, Ling 2.0, DeepSeek-MoE, Sarvam,
Param2, openPangu) are written by :mod:`vllm_afd.models.tiny_remote` through
the same two calls. Aria's checkpoint is its whole multimodal model (a tiny
vision tower and projector around the tiny text model) with transformers'
processor files and an image token (:func:`write_processor`), so it is
served with images.

Used by :func:`vllm_afd.models.tiny_checkpoint.write_tiny_checkpoint`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from vllm_afd.models.families import FAMILIES
from vllm_afd.models.tiny_remote import (
    REMOTE_FAMILIES,
    RemoteCodeConfig,
    remote_config,
    write_remote,
)

#: MLA dims of the tiny DeepSeek-style models: vLLM's CPU MLA takes
#: kv_lora_rank + qk_rope_head_dim = 576 only
_CPU_MLA: dict[str, Any] = dict(
    kv_lora_rank=512,
    q_lora_rank=96,
    qk_rope_head_dim=64,
    qk_nope_head_dim=32,
    v_head_dim=32,
    num_key_value_heads=4,
)

#: DeepSeek-V3's routing in the tiny GLM-4.5 and A.X K1 models: shared
#: experts, grouped sigmoid top-k (with the family's correction bias), routed
#: scaling
_GROUPED_SIGMOID: dict[str, Any] = dict(
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
)

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
            **_GROUPED_SIGMOID,
            use_qk_norm=True,
            head_dim=32,
            num_mtp_layers=0,
        ),
    ),
    # Every layer MoE, no shared experts, q/k norms, softmax top-k without
    # renormalisation.
    "olmoe": (
        "OlmoeConfig",
        dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    ),
    # AFMoE: a first dense layer, a shared expert, sigmoid top-k with a bias
    # the block holds, routed scaling; gated attention with q/k norms,
    # sliding and full layers (the release's routing keys:
    # :func:`_afmoe_release_keys`).
    "afmoe": (
        "AfmoeConfig",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            num_shared_experts=1,
            num_dense_layers=1,
            route_scale=2.0,
        ),
    ),
    # Every layer MoE, no shared experts, LayerNorm, attention biases (vLLM's
    # module builds them whatever the config says; the releases have them),
    # top-2 routing by sparsemixer (a routing function of vLLM's own).
    "phimoe": (
        "PhimoeConfig",
        dict(num_local_experts=8, num_experts_per_tok=2, attention_bias=True),
    ),
    # Every layer MoE, embedding, residual, attention and logit multipliers.
    "granitemoe": (
        "GraniteMoeConfig",
        dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
            logits_scaling=2.0,
        ),
    ),
    # Every layer MoE, no shared experts, sigmoid scores with a correction
    # bias held by the block, router in fp32 before the runner. Plain vLLM
    # serves it on GPUs only (its CPU router takes no sigmoid with a bias).
    "minimax_m2": (
        "MiniMaxM2Config",
        dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            head_dim=32,
            scoring_func="sigmoid",
            use_routing_bias=True,
            use_qk_norm=True,
            qk_norm_type="per_layer",
            rotary_dim=32,
        ),
    ),
    # First dense layer, a shared expert, softmax top-k.
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        dict(
            moe_num_experts=8,
            moe_k=2,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            moe_layer_interval=1,
            use_bias=False,
        ),
    ),
    # GLM-4.7-Flash: MLA attention (DeepSeek's), first dense layer, shared
    # experts, grouped sigmoid top-k with a bias, routed scaling.
    "glm4_moe_lite": (
        "Glm4MoeLiteConfig",
        dict(
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.8,
            norm_topk_prob=True,
            **_CPU_MLA,
            num_nextn_predict_layers=0,
        ),
    ),
    # A.X K1: DeepSeek-V3's layout (MLA, first dense layer, shared experts,
    # grouped sigmoid top-k with a bias, routed scaling) in its own module.
    "axk1": (
        "AXK1Config",
        dict(
            **_GROUPED_SIGMOID,
            **_CPU_MLA,
        ),
    ),
    # gpt-oss: router outside the block with a bias, expert biases, clamped
    # SwiGLU, attention sinks, sliding and full attention alternating.
    "gpt_oss": (
        "GptOssConfig",
        dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            head_dim=32,
            sliding_window=16,
            attention_bias=True,
        ),
    ),
    # Llama 4: the router weight scales the expert input, sigmoid top-1, a
    # shared expert, MoE and dense layers interleaved, layers without RoPE.
    "llama4": (
        "Llama4TextConfig",
        dict(
            num_local_experts=8,
            num_experts_per_tok=1,
            head_dim=32,
            interleave_moe_layer_step=2,
            no_rope_layers=None,
            no_rope_layer_interval=2,
            attention_chunk_size=None,
            use_qk_norm=True,
        ),
    ),
    # Granite-MoE with a shared MLP beside the MoE block at every layer.
    "granitemoeshared": (
        "GraniteMoeSharedConfig",
        dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            shared_intermediate_size=64,
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
            logits_scaling=2.0,
        ),
    ),
    # Qwen3-Next: gated delta-net linear attention and full attention mixed
    # (state on the attention side), a shared expert with a sigmoid gate.
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            shared_expert_intermediate_size=64,
            head_dim=32,
            linear_conv_kernel_dim=4,
            # vLLM's CPU kernel of the gated delta rule takes head dim 128
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
        ),
    ),
    # EXAONE-MoE: first dense layer, a shared expert, sigmoid grouped top-k
    # with a correction bias held by the MoE block, routed scaling; sliding
    # and full attention layers.
    "exaone_moe": (
        "ExaoneMoeConfig",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            num_shared_experts=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            head_dim=32,
            sliding_window=16,
            sliding_window_pattern=2,
        ),
    ),
    # Cohere's MoE: LayerNorm (no RMS), a logit scale, softmax top-k, a first
    # dense layer of its own width, a shared expert averaged with the routed
    # output, sliding and full attention layers.
    "cohere2_moe": (
        "Cohere2MoeConfig",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            num_shared_experts=1,
            shared_expert_combination_strategy="average",
            head_dim=32,
            sliding_window=16,
            sliding_window_pattern=2,
            logit_scale=0.125,
        ),
    ),
    # Gemma 4 (its MoE variant): every layer runs a dense MLP and, beside it,
    # routed experts with a router of its own (norm, scales, softmax over
    # all experts, per-expert scales), GELU experts; sliding and full
    # attention layers with their own head dims, per-layer embeddings.
    "gemma4": (
        "Gemma4TextConfig",
        dict(
            enable_moe_block=True,
            num_experts=8,
            top_k_experts=2,
            head_dim=32,
            global_head_dim=64,
            sliding_window=16,
            vocab_size_per_layer_input=None,  # the model's vocabulary
            hidden_size_per_layer_input=16,
            hidden_activation="gelu_pytorch_tanh",
        ),
    ),
    # MiMo-V2-Flash: a first dense layer, sigmoid grouped top-k with a
    # correction bias, full and sliding attention layers (sliding ones with
    # twice the KV heads and attention sinks), value heads of their own width.
    "mimo_v2": (
        "MiMoV2FlashConfig",
        dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            norm_topk_prob=True,
            head_dim=32,
            v_head_dim=32,
            sliding_window=16,
        ),
    ),
    # Qwen3.5-MoE (text): Qwen3-Next's MoE block (a shared expert with a
    # sigmoid gate, router in the runner) at every layer, gated delta-net
    # linear attention in three of four layers. Plain vLLM serves it on GPUs
    # only: its module imports the vision model, whose processor needs
    # torchvision.
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            shared_expert_intermediate_size=128,
            head_dim=32,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
        ),
    ),
    # Granite 4 (Granite-MoE-Hybrid): Mamba2 layers and attention layers
    # mixed (the Mamba state on the attention role), Granite-MoE's block
    # with a shared MLP beside it in every layer. Plain vLLM serves it on GPUs
    # only: on CPU its Mamba2 layer fails on all but short prompts.
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            shared_intermediate_size=128,
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
            logits_scaling=2.0,
            mamba_n_heads=8,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=64,
            mamba_expand=2,
            position_embedding_type="rope",
        ),
    ),
    # Aria (its text model's config; the checkpoint is the whole multimodal
    # model, with a one-layer vision tower and projector, :func:`_aria_config`,
    # and processor files, :func:`write_processor`): Llama's attention, every
    # layer MoE, a router weight the block holds itself (no gate module),
    # softmax top-k, shared experts passed into vLLM's MoE layer, the
    # experts stored fused and transposed (``experts.fc1``, ``experts.fc2``).
    "aria": (
        "AriaTextConfig",
        dict(
            moe_num_experts=8,
            moe_topk=2,
            moe_num_shared_experts=2,
            head_dim=32,
        ),
    ),
    # LFM2-MoE: short convolutions and attention layers mixed (conv state on
    # the attention side), a dense first layer, sigmoid top-k with an expert
    # bias on the gate.
    "lfm2_moe": (
        "Lfm2MoeConfig",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            num_dense_layers=1,
            use_expert_bias=True,
            norm_topk_prob=True,
            norm_eps=1e-6,
        ),
    ),
}

#: families whose ``intermediate_size`` is the width of an expert (no dense
#: layers): it is the tiny models' expert width
_EXPERT_WIDE = (
    "mixtral", "olmoe", "granitemoe", "granitemoeshared", "minimax_m2", "gpt_oss",
    "cohere2_moe", "granitemoehybrid", "aria", "phimoe",
)  # fmt: skip

# families whose releases ship their config class as code of their own: the
# config and weights are written by :mod:`vllm_afd.models.tiny_remote`
_FAMILIES.update({f: (c, moe) for f, (_, _, c, moe) in REMOTE_FAMILIES.items()})

HF_ARCHS = tuple(_FAMILIES)

#: the config keys families name their routed-expert count by
_EXPERT_KEYS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
)


def _experts_key(arch: str) -> str:
    moe = _FAMILIES[arch][1]
    return next(k for k in _EXPERT_KEYS if k in moe)


def default_experts(arch: str) -> int:
    """Routed experts of the tiny ``arch`` model by default."""
    return int(_FAMILIES[arch][1][_experts_key(arch)])


def check_num_experts(arch: str, num_experts: int) -> None:
    """ValueError unless ``num_experts`` is a positive multiple of ``arch``'s
    default count (so that its expert groups and top-k stay valid)."""
    default = default_experts(arch)
    if num_experts < 1 or num_experts % default:
        raise ValueError(
            f"num_experts={num_experts} must be a positive multiple of "
            f"{arch}'s {default} (its expert groups and top-k stay valid)"
        )


#: families plain vLLM serves on GPUs only (``vllm-afd demo`` offers the rest)
GPU_ONLY_ARCHS = ("minimax_m2", "qwen3_5_moe", "step3p5", "granitemoehybrid")
#: tiny families no record covers (docs/models.md says why): AFD refuses them
UNSERVED_ARCHS = ("lfm2_moe", "dbrx")
#: families AFD serves with the gate on the attention role only: a record's
#: ``layer_holds_moe`` (no MoE block class the FFN role could run), and those
#: whose layers run a dense MLP beside the MoE block (refused by the split)
GATE_ON_ATTENTION_ARCHS = (
    *(f.name for f in FAMILIES if f.layer_holds_moe),
    "granitemoeshared",
    "granitemoehybrid",
    "step3_text",
)
#: families plain vLLM serves on CPU in another dtype than fp32 only: its CPU
#: kernel of Qwen3-Next's gated delta-net attention asserts "CPU GDN
#: attention requires BF16"
CPU_DTYPES = {"qwen3_next": "bfloat16"}
#: Aria's image token and the two around it in the placeholder vLLM writes
#: into a chat prompt for an image (``<|fim_prefix|><|img|><|fim_suffix|>``),
#: special tokens of its release's tokenizer
ARIA_IMAGE_TOKEN = "<|img|>"
_ARIA_TOKENS = ("<|fim_prefix|>", ARIA_IMAGE_TOKEN, "<|fim_suffix|>")
#: special tokens a family's tokenizer holds after the trained vocabulary
ADDED_TOKENS: dict[str, tuple[str, ...]] = {"aria": _ARIA_TOKENS}
#: those of them the tokenizer names (``extra_special_tokens``):
#: ``AriaProcessor`` reads ``tokenizer.image_token`` and ``image_token_id``
NAMED_TOKENS: dict[str, dict[str, str]] = {"aria": {"image_token": ARIA_IMAGE_TOKEN}}
#: Aria's image side in the tiny checkpoint: ``AriaProcessor`` resizes every
#: image to its default ``max_image_size``, 980 (its call passes that default
#: over the image processor's own setting; 490 is the only other size it
#: takes), cut into 14x14 patches of 70 pixels, which the projector turns
#: into 16 queries: 16 image tokens per image
ARIA_IMAGE_SIZE = 980
_ARIA_PATCH = 70
ARIA_IMAGE_QUERIES = 16


def hf_config(
    arch: str,
    *,
    num_layers: int,
    vocab_size: int,
    hidden_size: int,
    dtype: str,
    special_ids: dict[str, int],
    max_positions: int,
    num_experts: int | None = None,
) -> Any:
    """The transformers config of a tiny ``arch`` model (layer 0 dense where
    the family has dense layers); ``num_experts`` routed experts instead of
    the family's default (:func:`default_experts`), a multiple of it
    (:func:`check_num_experts`, which the caller has run)."""
    import transformers

    class_name, moe = _FAMILIES[arch]
    if num_experts is not None:
        moe = {**moe, _experts_key(arch): num_experts}
    if arch in REMOTE_FAMILIES:
        return remote_config(
            arch,
            moe,
            num_layers=num_layers,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            dtype=dtype,
            special_ids=special_ids,
            max_positions=max_positions,
        )
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
    )
    kwargs.update(moe)
    if arch in ("qwen3_moe", "qwen2_moe", "qwen3_next"):
        kwargs["mlp_only_layers"] = [0]
    if arch == "granitemoehybrid":
        kwargs["layer_types"] = [
            "attention" if i % 2 else "mamba" for i in range(num_layers)
        ]
    if arch == "qwen3_5_moe":
        kwargs["layer_types"] = [
            "full_attention" if i % 4 == 3 else "linear_attention"
            for i in range(num_layers)
        ]
    if arch == "qwen3_next":
        kwargs["layer_types"] = [
            "linear_attention" if i % 2 == 0 else "full_attention"
            for i in range(num_layers)
        ]
    if arch == "llama4":
        # expert width intermediate_size, dense width intermediate_size_mlp
        kwargs["intermediate_size_mlp"] = kwargs["intermediate_size"]
        kwargs["intermediate_size"] = kwargs.pop("moe_intermediate_size")
    if arch in _EXPERT_WIDE:
        kwargs.pop("moe_intermediate_size")
        kwargs["intermediate_size"] = hidden_size // 2
    if arch in ("glm4_moe", "glm4_moe_lite", "axk1"):
        kwargs["first_k_dense_replace"] = 1
    if arch == "glm4_moe_lite":
        kwargs["mlp_layer_types"] = ["dense"] + ["sparse"] * (num_layers - 1)
    if arch == "cohere2_moe":
        kwargs["mlp_layer_types"] = ["dense"] + ["sparse"] * (num_layers - 1)
        kwargs["prefix_dense_intermediate_size"] = 2 * hidden_size
    if arch == "exaone_moe":
        kwargs["mlp_layer_types"] = ["dense"] + ["sparse"] * (num_layers - 1)
    if arch == "lfm2_moe":
        kwargs["layer_types"] = [
            "conv" if i % 2 else "full_attention" for i in range(num_layers)
        ]
    if arch == "gemma4":
        kwargs["vocab_size_per_layer_input"] = vocab_size
        kwargs["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(num_layers)
        ]
    if arch == "gpt_oss":
        kwargs["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(num_layers)
        ]
    if arch == "mimo_v2":
        kwargs["layer_types"] = [
            "full_attention" if i % 2 == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
        kwargs["mlp_layer_types"] = ["dense"] + ["sparse"] * (num_layers - 1)
    config = config_cls(**kwargs)
    if arch == "aria":
        image_id = vocab_size - len(_ARIA_TOKENS) + _ARIA_TOKENS.index(ARIA_IMAGE_TOKEN)
        return _aria_config(config, image_id)
    config.architectures = [
        type(config)
        .__name__.replace("TextConfig", "Config")
        .replace("Config", "ForCausalLM")
    ]
    if arch == "mimo_v2":
        _mimo_v2_release_keys(config)
    if arch == "afmoe":
        _afmoe_release_keys(config)
    return config


def _aria_config(text: Any, image_token_index: int) -> Any:
    """Aria's whole config around the tiny text model: a one-layer vision
    tower of 14x14 patches and a projector to 16 queries
    (:data:`ARIA_IMAGE_SIZE`)."""
    import transformers

    vision = transformers.Idefics3VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=ARIA_IMAGE_SIZE,
        patch_size=_ARIA_PATCH,
    )
    patches = (ARIA_IMAGE_SIZE // _ARIA_PATCH) ** 2
    config = transformers.AriaConfig(
        text_config=text,
        vision_config=vision,
        projector_patch_to_query_dict={patches: ARIA_IMAGE_QUERIES},
        image_token_index=image_token_index,
        tie_word_embeddings=False,
    )
    config.architectures = ["AriaForConditionalGeneration"]
    return config


def lacks_processor(arch: str, path: Path) -> bool:
    """A tiny checkpoint of a multimodal family written before its processor
    files were (served as a text model then): written again by the demo."""
    return arch in NAMED_TOKENS and not (path / "preprocessor_config.json").exists()


def write_processor(arch: str, out: Path) -> None:
    """A multimodal family's processor files beside its tokenizer (Aria:
    transformers' ``AriaImageProcessor`` config and ``AriaProcessor``'s
    ``size_conversion``, :data:`ARIA_IMAGE_SIZE`); nothing for the others."""
    if arch != "aria":
        return
    import json

    import transformers

    transformers.AriaImageProcessorPil(
        max_image_size=ARIA_IMAGE_SIZE, split_image=False
    ).save_pretrained(out)
    processor = {
        "processor_class": "AriaProcessor",
        "size_conversion": {str(ARIA_IMAGE_SIZE): ARIA_IMAGE_QUERIES},
    }
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")


def _mimo_v2_release_keys(config: Any) -> None:
    """Add the config keys of MiMo-V2-Flash's release, which vLLM's module
    reads (transformers' config class names the same layout otherwise, and
    its weights are saved under the release's names)."""
    sliding = [t == "sliding_attention" for t in config.layer_types]
    rope = config.rope_parameters
    config.hybrid_layer_pattern = [int(s) for s in sliding]
    config.moe_layer_freq = [int(t == "sparse") for t in config.mlp_layer_types]
    config.swa_num_attention_heads = config.num_attention_heads
    config.swa_num_key_value_heads = 2 * config.num_key_value_heads
    config.swa_head_dim = config.head_dim
    config.swa_v_head_dim = config.v_head_dim
    config.sliding_window_size = config.sliding_window
    config.add_swa_attention_sink_bias = True
    config.layernorm_epsilon = config.rms_norm_eps
    config.rope_theta = rope["full_attention"]["rope_theta"]
    config.swa_rope_theta = rope["sliding_attention"]["rope_theta"]
    config.partial_rotary_factor = rope["full_attention"]["partial_rotary_factor"]


def _afmoe_release_keys(config: Any) -> None:
    """Add the routing keys of AFMoE's release, which vLLM's module reads
    (transformers' config class routes by sigmoid scores, renormalised, in
    one group, and writes none of them), and alternate sliding and full
    attention layers with a window shorter than the test prompts."""
    config.score_func = "sigmoid"
    config.route_norm = True
    config.n_group = 1
    config.topk_group = 1
    config.layer_types = [
        "sliding_attention" if i % 2 == 0 else "full_attention"
        for i in range(config.num_hidden_layers)
    ]
    config.sliding_window = 64


def write_hf_weights(
    config: Any,
    out: Path,
    draw: Any,
    seed: int,
    dtype: torch.dtype,
) -> None:
    """Build the transformers model of ``config``, draw every tensor again by
    name and save it as transformers saves that family (a family with a
    config class of its own: as its release names them, with that class)."""
    if isinstance(config, RemoteCodeConfig):
        write_remote(config, out, draw, seed, dtype)
        return
    import transformers

    torch.manual_seed(seed)
    auto = (
        transformers.AutoModelForImageTextToText
        if config.model_type == "aria"
        else transformers.AutoModelForCausalLM
    )
    model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(draw(seed, name, tuple(tensor.shape), _kind(name)))
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    if config.model_type == "phimoe":
        _name_architecture(out, "PhiMoEForCausalLM")
    if config.model_type == "axk1":
        _axk1_dense_layer_norms(config, out, draw, seed, dtype)


def _name_architecture(out: Path, name: str) -> None:
    """Write ``name`` as the checkpoint's architecture: transformers saves its
    own class name, where vLLM's registry knows the family by another (Phi-MoE:
    ``PhimoeForCausalLM`` would be served by vLLM's Transformers backend)."""
    path = out / "config.json"
    config = json.loads(path.read_text())
    config["architectures"] = [name]
    path.write_text(json.dumps(config, indent=2) + "\n")


def _axk1_dense_layer_norms(
    config: Any, out: Path, draw: Any, seed: int, dtype: torch.dtype
) -> None:
    """vLLM's A.X K1 module builds and loads ``post_mlp_layernorm`` on every
    decoder layer (it applies it after MoE layers only); transformers' model
    has it on MoE layers only, so the dense layers' ones are added."""
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(path)
    for i in range(config.first_k_dense_replace):
        name = f"model.layers.{i}.post_mlp_layernorm.weight"
        shape = (config.hidden_size,)
        tensors[name] = draw(seed, name, shape, "norm").to(dtype)
    save_file(tensors, path, metadata={"format": "pt"})


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
    if leaf[-2] in ("gate", "router") and leaf[-1] == "weight":
        return "router"
    if name.endswith("_bias") or name.endswith(".sinks"):
        return "bias"
    return "linear"
