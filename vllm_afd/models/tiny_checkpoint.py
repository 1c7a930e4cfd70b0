"""Write a tiny random-weight MoE checkpoint, tokenizer included, made locally.

Families: DeepSeek-V2/V3 (written here, tensor by tensor) and Qwen3-MoE,
Qwen2-MoE, Mixtral and GLM-4.5 (config and layout from transformers' own
classes, :mod:`vllm_afd.models.tiny_hf`). The DeepSeek checkpoint uses the
layout of the published DeepSeek-V2/V3 Hugging Face checkpoints (one tensor
per routed expert, ``mlp.gate.e_score_correction_bias`` for V3), so vLLM's
``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` and the native
``transformers`` classes load it unchanged. Nothing is downloaded: the weights
come from a seeded generator and the tokenizer is a byte-level BPE trained on a small
built-in corpus.

Weights are scaled so that every sublayer adds an O(1) update to an O(1) residual
stream. Greedy decoding then depends on the whole context (not only on the last
token) and the routers spread tokens over many experts, which is what exactness tests
need: a degenerate model that repeats one token hides routing and ordering bugs.

Used by ``vllm-afd tiny-model`` and by the tests.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch

from vllm_afd.models.tiny_hf import (
    ADDED_TOKENS,
    HF_ARCHS,
    NAMED_TOKENS,
    check_num_experts,
    hf_config,
    write_hf_weights,
    write_processor,
)
from vllm_afd.models.tiny_own import OWN_WRITERS, mla_specs, mlp_specs

DEEPSEEK_ARCHS = ("deepseek_v2", "deepseek_v3")
#: families written tensor by tensor in vLLM's names (``tiny_own``)
OWN_ARCHS = tuple(OWN_WRITERS)
TINY_ARCHS = (*DEEPSEEK_ARCHS, *HF_ARCHS, *OWN_ARCHS)

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# MLA dims vLLM 0.32 supports: the CPU backend needs a 576-wide latent cache
# (kv_lora_rank + qk_rope_head_dim); the SM90 GPU backends also need 128-wide
# nope/value heads.
_KV_LORA_RANK = 512
_QK_ROPE_HEAD_DIM = 64
_CPU_HEAD_DIM = 32
_GPU_HEAD_DIM = 128

_DEFAULT_HIDDEN_SIZE = 128
_NUM_HEADS = 4
_MAX_POSITIONS = 2048
_TOKENIZER_VOCAB = 1024

# Residual-stream and logit scales (see the module docstring).
_EMBED_STD = 1.0
_LM_HEAD_GAIN = 3.0
_ROUTER_GAIN = 1.5
_NORM_JITTER = 0.1

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
_ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *_ROLE_TOKENS)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog near the river bank.
A small model can still teach us how a large system behaves.
Attention reads the context; the feed-forward network stores what it has learned.
Mixture of experts layers send each token to a few experts chosen by a router.
The router scores every expert, keeps the best ones, and weights their outputs.
Shared experts see every token, routed experts see only the tokens sent to them.
Once upon a time there was a little robot who wanted to learn to paint.
Every morning it walked to the hill, looked at the sky, and mixed new colours.
The weather today is sunny with a light wind from the west.
Tomorrow it may rain in the morning and clear up in the afternoon.
She opened the window, made a cup of tea, and started to write a letter.
He read the book twice because the ending surprised him the first time.
Numbers like one, two, three, four, five, six, seven, eight, nine and ten.
The capital of France is Paris, and the capital of Japan is Tokyo.
Water boils at one hundred degrees and freezes at zero degrees Celsius.
Please write a short poem about the sea, the moon, and the stars.
Can you explain how a computer stores a number in memory?
What is the best way to learn a new language quickly?
Hello! How are you doing today? I am fine, thank you for asking.
The server answered the request, streamed the tokens, and closed the connection.
Each layer of the network turns hidden states into slightly better hidden states.
Good software is simple to read, easy to test, and honest about its errors.
The garden was full of roses, tulips, daisies and tall green grass.
Children played in the park while their parents talked on the benches.
A train left the station at noon and arrived in the city before dinner.
Scientists measure, compare, and repeat their experiments many times.
The market sold bread, cheese, apples, oranges, fish and fresh vegetables.
History is the story of people, places, ideas, wars, and discoveries.
Music can make a quiet room feel warm and a long road feel short.
The teacher asked the class to count the stars they could see at night.
"""


def write_tiny_checkpoint(
    out_dir: str | Path,
    *,
    arch: str = "deepseek_v2",
    num_layers: int = 4,
    seed: int = 0,
    dtype: str = "float32",
    gpu_dims: bool = False,
    hidden_size: int | None = None,
    mxfp4_experts: bool = False,
    num_experts: int | None = None,
) -> Path:
    """Write a random-weight MoE checkpoint of family ``arch`` with a local
    tokenizer.

    Args:
        out_dir: Directory to write; created if missing, existing files replaced.
        arch: One of ``TINY_ARCHS``. ``deepseek_v2`` uses softmax greedy top-k;
            ``deepseek_v3`` uses sigmoid scores, a score-correction bias, grouped
            top-k and a routed scaling factor; the others are described in
            :mod:`vllm_afd.models.tiny_hf`.
        num_layers: Decoder layers; layer 0 is dense (Mixtral: MoE too), the
            rest are MoE (>= 2).
        seed: Seed of the weights. Same arguments give byte-identical files.
        dtype: Stored weight dtype: ``float32``, ``bfloat16`` or ``float16``.
        gpu_dims: Use 128-wide nope/value heads, as vLLM's GPU MLA backends need
            (DeepSeek only; the other families have no MLA).
        hidden_size: Model width (default 128); a multiple of the head count.
        mxfp4_experts: Store the routed experts in MXFP4 as gpt-oss's release
            does (``gpt_oss`` only; :mod:`vllm_afd.models.tiny_mxfp4`).
        num_experts: Routed experts per MoE layer instead of the family's
            default, a multiple of it (the families written from a config
            class, transformers' or the checkpoint's own: ``HF_ARCHS``). vLLM pads a
            quantized linear layer's output to 16 columns, so a router over
            16 experts is what online FP8 needs.

    Returns:
        The checkpoint directory.

    Raises:
        ValueError: An argument is out of range; the message names the valid values.
    """
    _check_args(arch, num_layers, dtype, hidden_size)
    if mxfp4_experts and arch != "gpt_oss":
        raise ValueError(
            f"mxfp4_experts is for arch='gpt_oss' (the format its release "
            f"ships), not {arch!r}"
        )
    if num_experts is not None:
        if arch not in HF_ARCHS:
            raise ValueError(
                f"num_experts is for the families written from a config class "
                f"({', '.join(HF_ARCHS)}), not {arch!r}"
            )
        check_num_experts(arch, num_experts)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    vocab_size = _write_tokenizer(
        out, ADDED_TOKENS.get(arch, ()), NAMED_TOKENS.get(arch, {})
    )
    shape: dict[str, Any] = dict(
        num_layers=num_layers,
        vocab_size=vocab_size,
        hidden_size=hidden_size or _DEFAULT_HIDDEN_SIZE,
        dtype=dtype,
        special_ids=_special_ids(),
        max_positions=_MAX_POSITIONS,
    )
    if arch in HF_ARCHS:
        config_obj = hf_config(arch, **shape, num_experts=num_experts)
        write_hf_weights(config_obj, out, draw, seed, _DTYPES[dtype])
        _write_generation_config(out, _special_ids())
        write_processor(arch, out)
        if mxfp4_experts:
            from vllm_afd.models.tiny_mxfp4 import quantize_experts_mxfp4

            quantize_experts_mxfp4(out)
        return out
    if arch in OWN_WRITERS:
        write_config, weight_specs = OWN_WRITERS[arch]
        config = write_config(**shape)
        specs = weight_specs(config)
    else:
        config = tiny_config(
            arch,
            num_layers=num_layers,
            vocab_size=vocab_size,
            dtype=dtype,
            gpu_dims=gpu_dims,
            hidden_size=hidden_size,
        )
        specs = _weight_specs(config)
    _write_json(out / "config.json", config)
    _write_generation_config(out, _special_ids())
    tensors = _random_weights(specs, seed, _DTYPES[dtype])
    _save_safetensors(tensors, out / "model.safetensors")
    return out


def _special_ids() -> dict[str, int]:
    return {
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
    }


def _write_generation_config(out: Path, ids: dict[str, int]) -> None:
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ids["bos_token_id"],
            "eos_token_id": ids["eos_token_id"],
            "do_sample": False,
        },
    )


def tiny_config(
    arch: str,
    *,
    num_layers: int = 4,
    vocab_size: int = _TOKENIZER_VOCAB,
    dtype: str = "float32",
    gpu_dims: bool = False,
    hidden_size: int | None = None,
) -> dict[str, Any]:
    """Return a DeepSeek ``config.json``; arguments as in ``write_tiny_checkpoint``."""
    _check_args(arch, num_layers, dtype, hidden_size)
    if arch not in DEEPSEEK_ARCHS:
        raise ValueError(f"tiny_config writes DeepSeek configs only, not {arch!r}")
    hidden = hidden_size or _DEFAULT_HIDDEN_SIZE
    head_dim = _GPU_HEAD_DIM if gpu_dims else _CPU_HEAD_DIM
    config: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "moe_intermediate_size": hidden // 2,
        "num_hidden_layers": num_layers,
        "num_attention_heads": _NUM_HEADS,
        "num_key_value_heads": _NUM_HEADS,
        "qk_nope_head_dim": head_dim,
        "v_head_dim": head_dim,
        "qk_rope_head_dim": _QK_ROPE_HEAD_DIM,
        "kv_lora_rank": _KV_LORA_RANK,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_shared_experts": 1,
        "hidden_act": "silu",
        "max_position_embeddings": _MAX_POSITIONS,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        # HF applies 1e-6 to the q/kv latent norms whatever the config says; vLLM
        # uses rms_norm_eps everywhere. Equal values keep the two exact.
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
        "torch_dtype": dtype,
    }
    if arch == "deepseek_v2":
        config.update(
            architectures=["DeepseekV2ForCausalLM"],
            model_type="deepseek_v2",
            q_lora_rank=None,
            n_routed_experts=8,
            num_experts_per_tok=2,
            topk_method="greedy",
            scoring_func="softmax",
            # vLLM reads n_group/topk_group even for greedy routing; one group of
            # all experts is plain top-k. HF's V2 router never renormalizes.
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
        )
    else:
        config.update(
            architectures=["DeepseekV3ForCausalLM"],
            model_type="deepseek_v3",
            q_lora_rank=hidden // 2,
            n_routed_experts=16,
            num_experts_per_tok=4,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            # Interleaved rotary pairs, as in the released V3 weights and vLLM.
            rope_interleave=True,
        )
    return dict(sorted(config.items()))


def _check_args(
    arch: str, num_layers: int, dtype: str, hidden_size: int | None
) -> None:
    if arch not in TINY_ARCHS:
        raise ValueError(f"arch={arch!r} is not supported; use one of {TINY_ARCHS}")
    if num_layers < 2:
        raise ValueError(
            f"num_layers={num_layers} is too small; use >= 2 (layer 0 is dense, "
            "the others are MoE)"
        )
    if dtype not in _DTYPES:
        raise ValueError(
            f"dtype={dtype!r} is not supported; use one of {tuple(_DTYPES)}"
        )
    if hidden_size is not None and (hidden_size < 16 or hidden_size % 16):
        raise ValueError(
            f"hidden_size={hidden_size} must be a positive multiple of 16 (>= 16)"
        )


# ---------------------------------------------------------------------------
# Weights


def _random_weights(
    specs: dict[str, tuple[tuple[int, ...], str]], seed: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The tensors of ``specs`` (name -> shape, init kind), each drawn from a
    generator seeded by (seed, name).

    Seeding per name keeps a tensor's values independent of the other tensors, so
    e.g. a 2-layer and a 4-layer checkpoint share their first layers.
    """
    return {
        name: draw(seed, name, shape, kind).to(dtype)
        for name, (shape, kind) in specs.items()
    }


def _weight_specs(config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Map checkpoint tensor name -> (shape, init kind)."""
    h = config["hidden_size"]
    experts = config["n_routed_experts"]

    specs: dict[str, tuple[tuple[int, ...], str]] = {
        "model.embed_tokens.weight": ((config["vocab_size"], h), "embed"),
        "model.norm.weight": ((h,), "norm"),
        "lm_head.weight": ((config["vocab_size"], h), "lm_head"),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        specs[f"{p}.input_layernorm.weight"] = ((h,), "norm")
        specs[f"{p}.post_attention_layernorm.weight"] = ((h,), "norm")
        specs.update(mla_specs(f"{p}.self_attn", config))
        m = f"{p}.mlp"
        if i < config["first_k_dense_replace"]:
            specs.update(mlp_specs(m, h, config["intermediate_size"]))
            continue
        specs[f"{m}.gate.weight"] = ((experts, h), "router")
        if config["topk_method"] == "noaux_tc":
            specs[f"{m}.gate.e_score_correction_bias"] = ((experts,), "bias")
        inter = config["moe_intermediate_size"]
        for e in range(experts):
            specs.update(mlp_specs(f"{m}.experts.{e}", h, inter))
        shared = inter * config["n_shared_experts"]
        specs.update(mlp_specs(f"{m}.shared_experts", h, shared))
    return specs


def draw(seed: int, name: str, shape: tuple[int, ...], kind: str) -> torch.Tensor:
    """Tensor ``name`` of kind embed|norm|bias|linear|router|lm_head, drawn from
    a generator seeded by ``(seed, name)``."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    fan_in = shape[-1]
    if kind == "embed":
        return x * _EMBED_STD
    if kind == "norm":
        # Not all ones, so a norm loaded into the wrong slot changes the output.
        return 1.0 + _NORM_JITTER * x
    if kind == "bias":
        # Same order as sigmoid scores, so the bias changes which experts win.
        return 0.1 * x
    gain = {"linear": 1.0, "router": _ROUTER_GAIN, "lm_head": _LM_HEAD_GAIN}[kind]
    # Unit-variance inputs give unit-variance outputs (times gain).
    return x * (gain / math.sqrt(fan_in))


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(
        {k: v.contiguous() for k, v in sorted(tensors.items())},
        str(path),
        metadata={"format": "pt"},
    )


# ---------------------------------------------------------------------------
# Tokenizer


def _write_tokenizer(
    out: Path, added: tuple[str, ...] = (), named: dict[str, str] | None = None
) -> int:
    """Train a byte-level BPE on the built-in corpus; return its vocabulary
    size. ``added``: special tokens appended after the trained vocabulary,
    ``named``: those of them the tokenizer names (``extra_special_tokens``,
    e.g. ``image_token``; ``tiny_hf.ADDED_TOKENS``, ``tiny_hf.NAMED_TOKENS``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=_TOKENIZER_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    assert bos_id == SPECIAL_TOKENS.index(BOS_TOKEN), "special tokens come first"
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A $B",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    tok.add_special_tokens(list(added))
    tok.save(str(out / "tokenizer.json"))
    extra: dict[str, Any] = {"extra_special_tokens": named} if named else {}
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "additional_special_tokens": list(_ROLE_TOKENS),
            "add_bos_token": True,
            "clean_up_tokenization_spaces": False,
            "model_max_length": _MAX_POSITIONS,
            "chat_template": CHAT_TEMPLATE,
            **extra,
        },
    )
    _write_json(
        out / "special_tokens_map.json",
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN},
    )
    return tok.get_vocab_size()


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
