"""Quantized routed experts on one GPU: AFD 1A1F with both roles on GPU 0
(cuda_ipc under MPS, FULL CUDA graphs for decode) against plain vLLM with
the same quantization on the same GPU, 16 prompts token for token.

* FP8: vLLM's online quantization of a bf16 Qwen3-MoE with per-channel
  weight scales and per-token activation scales (``--quantization
  fp8_per_channel``): each role quantizes the layers it holds as it loads
  them (the experts on the FFN role), with the gate on either role. Not the
  per-tensor scheme (``fp8``): its activation scale is the maximum over all
  rows of a step, so plain vLLM's own output for a request depends on which
  requests shared its steps (on one H100 AFD and plain vLLM then agreed on
  0 of 16 requests, those inspected diverging after 7-26 tokens). The
  model has 16 experts: vLLM 0.32.0 pads an online-FP8 linear layer's
  output to a multiple of 16 columns and, when it pads a per-channel one,
  sets the weight's loader twice and fails its own assertion
  ("Overwriting existing tensor attribute: weight_loader"), so plain vLLM
  cannot load a router over the tiny model's default 8 experts.
* MXFP4: a gpt-oss checkpoint whose experts are stored in MXFP4 as the
  release ships them (``tiny-model --mxfp4-experts``). vLLM's MXFP4 kernels
  on Hopper route inside themselves, so the gate runs on the FFN role (with
  it on attention the FFN role refuses to start, naming the kernel).

vLLM's CPU build serves neither, so these run on a GPU only. The ``async``
connector refuses to split quantized experts over FFN ranks
(tests/unit/test_expert_slices.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_harness import (
    ONE_GPU,
    ONE_GPU_GRAPHS,
    afd_and_plain,
    gpu_spec,
    same_count,
)
from harness import assert_same_outputs, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(1)]

ATOL = 1e-2
GRAPHS = ONE_GPU_GRAPHS
#: (arch, quantization, gate on attention)
CASES = [
    ("qwen3_moe", "fp8_per_channel", False),
    ("qwen3_moe", "fp8_per_channel", True),
    ("gpt_oss", "mxfp4", False),
]


@pytest.fixture(scope="module")
def fp8_qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_afd.models.tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("fp8") / "qwen3_moe",
        arch="qwen3_moe",
        num_layers=4,
        dtype="bfloat16",
        num_experts=16,
    )


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_afd.models.tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("mxfp4") / "gpt_oss",
        arch="gpt_oss",
        num_layers=4,
        dtype="bfloat16",
        hidden_size=256,
        mxfp4_experts=True,
    )


@pytest.mark.parametrize(
    ("arch", "quantization", "gate_on_attention"),
    CASES,
    ids=[f"{a}-{q}-gate_on_{'attention' if g else 'ffn'}" for a, q, g in CASES],
)
def test_quantized_experts_on_one_gpu_equal_plain_vllm(
    fp8_qwen3_moe: Path,
    mxfp4_gpt_oss: Path,
    tmp_path: Path,
    arch: str,
    quantization: str,
    gate_on_attention: bool,
    mps: None,
) -> None:
    if quantization == "mxfp4":
        model, args = mxfp4_gpt_oss, GRAPHS  # the checkpoint says mxfp4
    else:
        model, args = fp8_qwen3_moe, [*GRAPHS, "--quantization", quantization]
    spec = gpu_spec(model, args, gate_on_attention=gate_on_attention, **ONE_GPU)
    afd_out, plain_out, ffn = afd_and_plain(spec, prompts(16), tmp_path)
    log = (tmp_path / "afd.log").read_text()
    print(f"{arch} {quantization}: {same_count(afd_out, plain_out)}/16 identical")
    assert_same_outputs(afd_out, plain_out, ATOL)
    assert ffn[("afd_steps", "ffn", "0")] > 0
    assert "AFD cuda_ipc data plane" in log, "the roles did not use cuda_ipc"
