"""The attention backend of MLA models on CPUs with AMX.

vLLM 0.32 serves a model with multi-head latent attention (DeepSeek-V2/V3,
GLM-4.7-Flash, ...) on a CPU with AMX tiles through its AMX MLA backend,
which converts the weights for AMX and takes bfloat16 (or 8-bit) weights
only: in float32 plain vLLM and every AFD attention role stop at start-up
with ``expect weight to be bfloat16, float16, int8, fp8_e4m3 or
uint8(mxfp4 or int4)``. Its reference CPU MLA backend (what vLLM picks on a
CPU without AMX) serves every dtype. :func:`cpu_mla_args` names it where
vLLM would otherwise pick AMX; ``vllm-afd demo`` and the tests pass them to
AFD and to plain vLLM alike, so both run the same backend on any host.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

#: what selects vLLM's reference CPU MLA backend
CPU_MLA_ARGS = ("--attention-backend", "CPU_MLA")


def is_mla_checkpoint(model: str | Path) -> bool:
    """Whether the local checkpoint's config has a KV latent (MLA)."""
    config = Path(model) / "config.json"
    if not config.is_file():
        return False
    values = json.loads(config.read_text())
    text = values.get("text_config") or {}
    return bool(values.get("kv_lora_rank") or text.get("kv_lora_rank"))


def amx_mla_would_serve() -> bool:
    """Whether vLLM here would serve MLA with its AMX backend: a CPU build of
    vLLM (no CUDA) on an x86 CPU with AMX tiles, as vLLM itself checks."""
    import torch

    if torch.cuda.is_available():
        return False
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def cpu_mla_args(model: str | Path, vllm_args: Sequence[str] = ()) -> list[str]:
    """``CPU_MLA_ARGS`` where vLLM would serve ``model`` with AMX MLA and
    ``vllm_args`` name no attention backend; else nothing."""
    if any(a.startswith("--attention-backend") for a in vllm_args):
        return []
    if is_mla_checkpoint(model) and amx_mla_would_serve():
        return list(CPU_MLA_ARGS)
    return []
