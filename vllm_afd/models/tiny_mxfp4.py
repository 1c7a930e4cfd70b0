"""MXFP4 routed experts for a tiny gpt-oss checkpoint, in the released layout.

gpt-oss ships its routed experts in MXFP4 (OCP microscaling: blocks of 32
FP4 E2M1 values sharing one E8M0 power-of-two scale) and everything else in
bf16. :func:`quantize_experts_mxfp4` rewrites the experts of a checkpoint
that :func:`~vllm_afd.models.tiny_checkpoint.write_tiny_checkpoint` wrote
for ``gpt_oss`` the way the release stores them, so vLLM loads it with its
own MXFP4 path (``quant_method: mxfp4``)::

    model.layers.N.mlp.experts.gate_up_proj_blocks  uint8 [E, 2I, H/32, 16]
    model.layers.N.mlp.experts.gate_up_proj_scales  uint8 [E, 2I, H/32]
    model.layers.N.mlp.experts.down_proj_blocks     uint8 [E, H, I/32, 16]
    model.layers.N.mlp.experts.down_proj_scales     uint8 [E, H, I/32]

Two FP4 codes per byte, the even element in the low nibble; a scale byte is
the power of two plus 127. The biases stay bf16. vLLM serves MXFP4 experts
on GPUs only.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

#: magnitudes of the FP4 E2M1 codes 0..7 (code | 8 is the negative)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: values that share one scale
BLOCK = 32
#: the largest E2M1 exponent: a block's scale is 2^(floor(log2 amax) - 2)
_EMAX = 2


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [..., K]`` (K a multiple of 32) as MXFP4: ``blocks [..., K/32,
    16]`` uint8 and ``scales [..., K/32]`` uint8 (E8M0), round to nearest.

    Raises:
        ValueError: K is not a multiple of 32.
    """
    k = weight.shape[-1]
    if k % BLOCK:
        raise ValueError(f"MXFP4 needs a last dimension divisible by {BLOCK}, not {k}")
    x = weight.float().reshape(*weight.shape[:-1], k // BLOCK, BLOCK)
    amax = x.abs().amax(dim=-1, keepdim=True).clamp(min=2.0**-126)
    exponent = torch.floor(torch.log2(amax)) - _EMAX
    scaled = (x / torch.exp2(exponent)).clamp(-E2M1[-1], E2M1[-1])
    grid = torch.tensor(E2M1)
    codes = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(dim=-1).to(torch.uint8)
    codes |= (scaled < 0).to(torch.uint8) << 3
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exponent.squeeze(-1) + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 values of :func:`quantize_mxfp4`'s output, ``[..., K]``."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()
    values = torch.tensor(E2M1)[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    values = values * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return values.flatten(-2)


def quantize_experts_mxfp4(checkpoint: str | Path) -> Path:
    """Rewrite a tiny gpt-oss checkpoint's routed experts as MXFP4 in place
    (weights and ``config.json``); returns the checkpoint directory.

    Raises:
        ValueError: the checkpoint is not a gpt-oss one, or its widths are not
            multiples of 32.
    """
    from safetensors.torch import load_file, save_file

    out = Path(checkpoint)
    config = json.loads((out / "config.json").read_text())
    if config.get("model_type") != "gpt_oss":
        raise ValueError(
            f"MXFP4 experts are written for gpt_oss checkpoints (the released "
            f"format), not {config.get('model_type')!r}"
        )
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    for name in [n for n in tensors if n.endswith((".gate_up_proj", ".down_proj"))]:
        # transformers stores [E, in, out]; the release stores [E, out, in/32, 16]
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2))
        tensors[f"{name}_blocks"] = blocks
        tensors[f"{name}_scales"] = scales
    save_file(tensors, str(path), metadata={"format": "pt"})
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
