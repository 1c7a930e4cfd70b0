"""The families added last, exact on one GPU: AFD 1A1F with both roles on GPU 0
(cuda_ipc under MPS), the gate on the attention role, FULL CUDA graphs for
decode, token-for-token against plain vLLM on the same GPU (16 prompts, top-5
logprobs within bf16's resolution). Llama 4 (the routing weight scales the
expert input), Granite-MoE-Shared (a shared MLP beside the MoE block),
Qwen3-Next (gated delta-net linear attention, its state on the attention
role), EXAONE-MoE, Cohere2-MoE, Gemma 4 and MiMo-V2-Flash; on CPU they are
checked in tests/e2e/test_families.py. Three families plain vLLM serves on
GPUs only are checked here alone: MiniMax-M2 (plain vLLM's CPU router takes
no sigmoid scores with a bias; Step-3.5, which is in the list too, gives plain
vLLM's NaN logprobs and is skipped), Qwen3.5-MoE (vLLM's module
imports its vision model, which needs torchvision) and Granite 4
(Granite-MoE-Hybrid: plain vLLM's CPU Mamba2 layer fails on all but short
prompts). MiniMax-M2 runs in its
other placements too: the gate on the FFN role, and 2A1F (both attention
ranks on GPU 0: each computes on its own requests only, plain vLLM on all).
Families whose plain output depends on how requests fall into steps run with
vLLM's batch-invariant kernels on every server (``BATCH_VARIANT``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_harness import (
    ONE_GPU,
    ONE_GPU_ARGS,
    ONE_GPU_GRAPHS,
    afd_and_plain,
    gpu_spec,
    same_count,
)
from harness import assert_same_outputs, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(1)]

ATOL = 1e-2
GRAPHS = ONE_GPU_GRAPHS
FAMILIES = (
    "llama4",
    "granitemoeshared",
    "qwen3_next",
    "exaone_moe",
    "cohere2_moe",
    "gemma4",
    "mimo_v2",
    "minimax_m2",
    "qwen3_5_moe",
    "step3p5",
    "granitemoehybrid",
)
#: families with no plain vLLM reference on a GPU: skipped, the reason given
NO_REFERENCE = {
    "step3p5": "on one H100 plain vLLM 0.32's own answers on this checkpoint "
    "carry NaN logprobs, with batch-invariant kernels and without "
    "(docs/models.md)",
}
CASES = [
    pytest.param(a, marks=pytest.mark.skip(reason=NO_REFERENCE[a]))
    if a in NO_REFERENCE
    else a
    for a in FAMILIES
]
#: vLLM arguments a family needs on a GPU, on AFD and plain alike: the gated
#: delta-net families take vLLM's Triton prefill kernel, since flashinfer's
#: (the default on Hopper) imports the CUTLASS DSL package, which vLLM's
#: wheel does not bring
EXTRA_ARGS = {
    "qwen3_next": ["--gdn-prefill-backend", "triton"],
    "qwen3_5_moe": ["--gdn-prefill-backend", "triton"],
}
#: families whose plain vLLM output depends on how requests fall into steps:
#: their router's float32 gate GEMM (vLLM's ``GateLinear``) picks its kernel by
#: the step's row count, and sigmoid scores with a bias turn the last bit into
#: another expert. The same settings gave MiniMax-M2 15/16 and 16/16 identical
#: in two runs on one H200, and EXAONE-MoE 14/16 on one H100. Every server of
#: such a family runs vLLM's batch-invariant kernels.
BATCH_VARIANT = {"exaone_moe", "minimax_m2"}
BATCH_INVARIANT = {"VLLM_BATCH_INVARIANT": "1"}


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from vllm_afd.models.tiny_checkpoint import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("families-gpu")
    return {
        arch: write_tiny_checkpoint(
            root / arch, arch=arch, num_layers=4, dtype="bfloat16"
        )
        for arch in FAMILIES
        if arch not in NO_REFERENCE
    }


@pytest.mark.parametrize("arch", CASES)
def test_family_1a1f_on_one_gpu_equals_plain_vllm(
    family_models: dict[str, Path], tmp_path: Path, arch: str, mps: None
) -> None:
    args = GRAPHS + EXTRA_ARGS.get(arch, [])
    spec = gpu_spec(family_models[arch], args, gate_on_attention=True, **ONE_GPU)
    env = BATCH_INVARIANT if arch in BATCH_VARIANT else None
    afd_out, plain_out, ffn = afd_and_plain(spec, prompts(16), tmp_path, env)
    same = sum(
        a.token_ids == p.token_ids for a, p in zip(afd_out, plain_out, strict=True)
    )
    print(f"{arch}: {same}/16 identical")
    assert_same_outputs(afd_out, plain_out, ATOL)
    assert ffn[("afd_steps", "ffn", "0")] > 0


#: families plain vLLM serves on GPUs only, in their other placements (eager):
#: (arch, gate on attention, attention ranks)
GPU_ONLY_PLACEMENTS = [("minimax_m2", False, 1), ("minimax_m2", True, 2)]


@pytest.mark.parametrize(
    ("arch", "gate_on_attention", "ranks"),
    GPU_ONLY_PLACEMENTS,
    ids=[
        f"{a}-{n}A1F-gate_on_{'attention' if g else 'ffn'}"
        for a, g, n in GPU_ONLY_PLACEMENTS
    ],
)
def test_gpu_only_family_placements_equal_plain_vllm(
    family_models: dict[str, Path],
    tmp_path: Path,
    arch: str,
    gate_on_attention: bool,
    ranks: int,
    mps: None,
) -> None:
    spec = gpu_spec(
        family_models[arch],
        ONE_GPU_ARGS,
        gate_on_attention=gate_on_attention,
        attention_ranks=ranks,
        **ONE_GPU,
    )
    afd_out, plain_out, ffn = afd_and_plain(
        spec, prompts(16), tmp_path, BATCH_INVARIANT
    )
    print(f"{arch} {ranks}A1F: {same_count(afd_out, plain_out)}/16 identical")
    assert_same_outputs(afd_out, plain_out, ATOL)
    assert ffn[("afd_steps", "ffn", "0")] > 0
