"""Unit tests for the tiny random-weight checkpoint writer (no vLLM needed)."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

from vllm_afd.models.tiny_checkpoint import (
    BOS_TOKEN,
    EOS_TOKEN,
    TINY_ARCHS,
    tiny_config,
    write_tiny_checkpoint,
)


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _tensor_names(path: Path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_write_same_seed_gives_identical_files(tmp_path: Path, arch: str) -> None:
    a = write_tiny_checkpoint(tmp_path / "a", arch=arch, num_layers=2, seed=3)
    b = write_tiny_checkpoint(tmp_path / "b", arch=arch, num_layers=2, seed=3)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_write_different_seed_gives_different_weights(tmp_path: Path) -> None:
    a = write_tiny_checkpoint(tmp_path / "a", num_layers=2, seed=0)
    b = write_tiny_checkpoint(tmp_path / "b", num_layers=2, seed=1)
    assert (a / "model.safetensors").read_bytes() != (
        b / "model.safetensors"
    ).read_bytes()


def test_write_produces_hf_checkpoint_files(tmp_path: Path) -> None:
    out = write_tiny_checkpoint(tmp_path / "ckpt", num_layers=2)
    for name in (
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (out / name).is_file(), name


def test_config_v2_uses_softmax_greedy_routing(tmp_path: Path) -> None:
    out = write_tiny_checkpoint(tmp_path / "v2", arch="deepseek_v2", num_layers=3)
    cfg = _config(out)
    assert cfg["architectures"] == ["DeepseekV2ForCausalLM"]
    assert cfg["model_type"] == "deepseek_v2"
    assert cfg["scoring_func"] == "softmax"
    assert cfg["topk_method"] == "greedy"
    assert cfg["routed_scaling_factor"] == 1.0
    assert cfg["first_k_dense_replace"] >= 1
    assert cfg["num_hidden_layers"] == 3
    assert cfg["tie_word_embeddings"] is False
    names = _tensor_names(out)
    assert not any("e_score_correction_bias" in n for n in names)
    assert "model.layers.0.mlp.gate_proj.weight" in names
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in names


def test_config_v3_uses_biased_grouped_sigmoid_routing(tmp_path: Path) -> None:
    out = write_tiny_checkpoint(tmp_path / "v3", arch="deepseek_v3", num_layers=3)
    cfg = _config(out)
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["model_type"] == "deepseek_v3"
    assert cfg["scoring_func"] == "sigmoid"
    assert cfg["topk_method"] == "noaux_tc"
    assert cfg["n_group"] > 1
    assert cfg["topk_group"] < cfg["n_group"]
    assert cfg["routed_scaling_factor"] != 1.0
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
    assert bias.shape == (cfg["n_routed_experts"],)
    assert bool((bias != 0).all())


@pytest.mark.parametrize("gpu_dims, head_dim", [(False, 32), (True, 128)])
def test_config_mla_dims_match_vllm_backends(gpu_dims: bool, head_dim: int) -> None:
    cfg = tiny_config("deepseek_v3", gpu_dims=gpu_dims)
    assert cfg["kv_lora_rank"] == 512
    assert cfg["qk_rope_head_dim"] == 64
    assert cfg["qk_nope_head_dim"] == head_dim
    assert cfg["v_head_dim"] == head_dim


def test_write_hidden_size_and_dtype_are_applied(tmp_path: Path) -> None:
    out = write_tiny_checkpoint(
        tmp_path / "c", num_layers=2, hidden_size=64, dtype="bfloat16"
    )
    assert _config(out)["hidden_size"] == 64
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    assert embed.shape[1] == 64
    assert str(embed.dtype) == "torch.bfloat16"


def test_tokenizer_round_trips_text(tmp_path: Path) -> None:
    out = write_tiny_checkpoint(tmp_path / "t", num_layers=2)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "Hello! The quick brown fox reads 42 books, naïvely."
    enc = tok.encode(text)
    assert enc.ids[0] == tok.token_to_id(BOS_TOKEN)
    assert tok.decode(enc.ids, skip_special_tokens=True) == text
    assert tok.get_vocab_size() == _config(out)["vocab_size"]


def test_tokenizer_config_has_special_tokens_and_chat_template(
    tmp_path: Path,
) -> None:
    out = write_tiny_checkpoint(tmp_path / "t", num_layers=2)
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["bos_token"] == BOS_TOKEN
    assert tok_cfg["eos_token"] == EOS_TOKEN
    prompt = jinja2.Template(tok_cfg["chat_template"]).render(
        messages=[{"role": "user", "content": "hi"}],
        add_generation_prompt=True,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
    )
    assert prompt == f"{BOS_TOKEN}<|user|>\nhi{EOS_TOKEN}\n<|assistant|>\n"
    cfg = _config(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert cfg["bos_token_id"] == tok.token_to_id(BOS_TOKEN)
    assert cfg["eos_token_id"] == tok.token_to_id(EOS_TOKEN)


def test_write_bad_arch_raises_naming_valid_archs(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as exc:
        write_tiny_checkpoint(tmp_path / "x", arch="llama")
    for arch in TINY_ARCHS:
        assert arch in str(exc.value)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"num_layers": 1}, "num_layers"),
        ({"dtype": "int8"}, "dtype"),
        ({"hidden_size": 100}, "hidden_size"),
    ],
)
def test_write_bad_argument_raises_naming_field(
    tmp_path: Path, kwargs: dict, field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        write_tiny_checkpoint(tmp_path / "x", **kwargs)


#: family -> (architecture, a router weight of layer 1, a layer-0 weight)
HF_LAYOUTS = {
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "model.layers.1.mlp.gate.weight",
        "model.layers.0.mlp.gate_proj.weight",  # mlp_only_layers=[0]: dense
    ),
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        "model.layers.1.mlp.shared_expert_gate.weight",
        "model.layers.0.mlp.up_proj.weight",
    ),
    "mixtral": (
        "MixtralForCausalLM",
        "model.layers.1.block_sparse_moe.gate.weight",
        "model.layers.0.block_sparse_moe.experts.7.w2.weight",  # all MoE
    ),
    # vLLM's registry name, not transformers' (PhimoeForCausalLM), and the
    # attention biases vLLM's module builds
    "phimoe": (
        "PhiMoEForCausalLM",
        "model.layers.1.block_sparse_moe.gate.weight",
        "model.layers.0.self_attn.o_proj.bias",
    ),
    # the score bias on the block, a first dense layer
    "afmoe": (
        "AfmoeForCausalLM",
        "model.layers.1.mlp.expert_bias",
        "model.layers.0.mlp.gate_proj.weight",
    ),
    "glm4_moe": (
        "Glm4MoeForCausalLM",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.0.mlp.down_proj.weight",  # first_k_dense_replace=1
    ),
}


@pytest.mark.parametrize("arch", sorted(HF_LAYOUTS))
def test_write_hf_family_has_its_published_moe_layout(tmp_path: Path, arch: str):
    out = write_tiny_checkpoint(tmp_path / arch, arch=arch, num_layers=2, seed=1)
    architecture, router, layer0 = HF_LAYOUTS[arch]
    cfg = _config(out)
    assert cfg["architectures"] == [architecture]
    assert cfg["bos_token_id"] == 0 and cfg["num_hidden_layers"] == 2
    names = _tensor_names(out)
    assert {router, layer0} <= names
    # one tensor per routed expert, as the published checkpoints store them
    assert any(".experts.0." in n and n.startswith("model.layers.1.") for n in names)


def test_write_hf_family_weights_are_drawn_with_the_scales(tmp_path: Path) -> None:
    out = write_tiny_checkpoint(tmp_path / "q", arch="qwen3_moe", num_layers=2)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        norm = f.get_tensor("model.layers.0.input_layernorm.weight")
        embed = f.get_tensor("model.embed_tokens.weight")
    # norms near one (not all ones), embeddings of unit variance
    assert 0.5 < float(norm.mean()) < 1.5 and float(norm.std()) > 0.01
    assert 0.8 < float(embed.std()) < 1.2


def test_mxfp4_round_trips_the_fp4_grid_and_rounds_to_the_nearest() -> None:
    import torch

    from vllm_afd.models.tiny_mxfp4 import E2M1, dequantize_mxfp4, quantize_mxfp4

    grid = torch.tensor([v * s for v in E2M1 for s in (1, -1)] * 2)[:32]
    blocks, scales = quantize_mxfp4(grid * 2.0**-5)
    assert blocks.shape == (1, 16) and blocks.dtype == torch.uint8
    assert scales.tolist() == [127 - 5]  # amax 1.5 * 2^-3: scale 2^(-3 - 2)
    assert torch.equal(dequantize_mxfp4(blocks, scales), grid * 2.0**-5)
    # 2.4 lies nearer 2 than 3; the low nibble holds the even element
    blocks, scales = quantize_mxfp4(torch.tensor([2.4, 6.0] + [0.0] * 30))
    assert dequantize_mxfp4(blocks, scales)[:2].tolist() == [2.0, 6.0]
    assert blocks[0, 0].item() == 4 | (7 << 4)
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_mxfp4(torch.zeros(2, 48))


def test_mxfp4_experts_are_written_in_the_released_layout(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from vllm_afd.models.tiny_mxfp4 import dequantize_mxfp4

    dense = write_tiny_checkpoint(
        tmp_path / "bf16", arch="gpt_oss", num_layers=2, dtype="bfloat16"
    )
    path = write_tiny_checkpoint(
        tmp_path / "mx", arch="gpt_oss", num_layers=2, dtype="bfloat16",
        mxfp4_experts=True,
    )  # fmt: skip
    assert _config(path)["quantization_config"]["quant_method"] == "mxfp4"
    weights, original = (
        load_file(path / "model.safetensors"),
        load_file(dense / "model.safetensors"),
    )
    experts = "model.layers.1.mlp.experts"
    e, h, two_i = original[f"{experts}.gate_up_proj"].shape
    assert weights[f"{experts}.gate_up_proj_blocks"].shape == (e, two_i, h // 32, 16)
    assert weights[f"{experts}.gate_up_proj_scales"].shape == (e, two_i, h // 32)
    assert weights[f"{experts}.down_proj_blocks"].shape == (e, h, two_i // 64, 16)
    assert f"{experts}.gate_up_proj" not in weights
    assert weights[f"{experts}.gate_up_proj_bias"].dtype == torch.bfloat16
    # what vLLM dequantizes is the drawn weight, transposed, to FP4's precision
    values = dequantize_mxfp4(
        weights[f"{experts}.down_proj_blocks"], weights[f"{experts}.down_proj_scales"]
    )
    drawn = original[f"{experts}.down_proj"].float().transpose(1, 2)
    assert (values - drawn).abs().max() <= drawn.abs().max() / 4
    with pytest.raises(ValueError, match="gpt_oss"):
        write_tiny_checkpoint(tmp_path / "q", arch="qwen3_moe", mxfp4_experts=True)


@pytest.mark.parametrize(("arch", "experts"), [("qwen3_moe", 16), ("glm4_moe", 32)])
def test_num_experts_sets_the_routed_experts(
    tmp_path: Path, arch: str, experts: int
) -> None:
    out = write_tiny_checkpoint(
        tmp_path / arch, arch=arch, num_layers=2, num_experts=experts
    )
    cfg = _config(out)
    counts = [
        cfg[k]
        for k in ("num_experts", "num_local_experts", "n_routed_experts")
        if k in cfg
    ]
    assert counts == [experts]
    names = _tensor_names(out)
    assert any(f".experts.{experts - 1}." in n for n in names)
    assert not any(f".experts.{experts}." in n for n in names)


@pytest.mark.parametrize(
    ("arch", "experts", "message"),
    [
        ("qwen3_moe", 12, "must be a positive multiple of qwen3_moe's 8"),
        ("glm4_moe", 8, "must be a positive multiple of glm4_moe's 16"),
        ("deepseek_v2", 16, "not 'deepseek_v2'"),
    ],
)
def test_num_experts_refuses_what_the_family_cannot_take(
    tmp_path: Path, arch: str, experts: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        write_tiny_checkpoint(tmp_path / "m", arch=arch, num_experts=experts)


def test_aria_checkpoint_processes_an_image(tmp_path: Path) -> None:
    """Aria's tiny checkpoint carries transformers' processor (the PIL image
    processor where torchvision is absent) and the image token its config
    names: an image becomes the projector's 16 queries' tokens, at the one
    image size its vision tower takes."""
    from PIL import Image
    from transformers import AutoProcessor

    from vllm_afd.models.tiny_hf import (
        ARIA_IMAGE_QUERIES,
        ARIA_IMAGE_SIZE,
        lacks_processor,
    )

    out = write_tiny_checkpoint(tmp_path / "aria", arch="aria", num_layers=2)
    cfg = _config(out)
    processor = AutoProcessor.from_pretrained(out)
    image_id = processor.tokenizer.image_token_id
    assert cfg["image_token_index"] == image_id
    assert cfg["text_config"]["vocab_size"] == len(processor.tokenizer)
    # vLLM's placeholder of an image in a chat prompt
    text = "look <|fim_prefix|><|img|><|fim_suffix|> here"
    got = processor(text=[text], images=[Image.new("RGB", (8, 8))], return_tensors="pt")
    ids = got["input_ids"][0].tolist()
    assert ids.count(image_id) == ARIA_IMAGE_QUERIES
    assert tuple(got["pixel_values"].shape) == (1, 3, ARIA_IMAGE_SIZE, ARIA_IMAGE_SIZE)
    patches = (ARIA_IMAGE_SIZE // cfg["vision_config"]["patch_size"]) ** 2
    assert cfg["projector_patch_to_query_dict"] == {str(patches): ARIA_IMAGE_QUERIES}
    assert not lacks_processor("aria", out)
    (out / "preprocessor_config.json").unlink()
    assert lacks_processor("aria", out)
    # the other families' tokenizers hold no added tokens
    other = write_tiny_checkpoint(tmp_path / "q", arch="qwen3_moe", num_layers=2)
    assert "extra_special_tokens" not in json.loads(
        (other / "tokenizer_config.json").read_text()
    )
