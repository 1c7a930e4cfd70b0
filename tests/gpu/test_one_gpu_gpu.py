"""AFD 1A1F with both roles on one GPU: the cuda_ipc data plane under MPS.

Attention and FFN role processes on GPU 0 (with both device lists naming it,
the launcher asks for cuda_ipc), each with a fixed KV cache; tiny bf16
DeepSeek-V2 and -V3, eager and with FULL CUDA graphs for decode, and tiny
Qwen3-MoE and Mixtral with FULL CUDA graphs (the generic role split). 16 prompts,
token-for-token against plain vLLM on the same GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_harness import ONE_GPU, ONE_GPU_ARGS, ONE_GPU_GRAPHS, afd_and_plain, gpu_spec
from harness import assert_same_outputs, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(1)]

ATOL = 1e-2
EAGER = ONE_GPU_ARGS
GRAPHS = ONE_GPU_GRAPHS


CASES = [
    (arch, mode)
    for arch in ("deepseek_v2", "deepseek_v3")
    for mode in ("eager", "full-decode-graphs")
] + [(arch, "full-decode-graphs") for arch in ("qwen3_moe", "mixtral")]


@pytest.mark.parametrize(("arch", "mode"), CASES)
def test_afd_1a1f_on_one_gpu_equals_plain_vllm(
    gpu_tiny_models: dict[str, Path], tmp_path: Path, arch: str, mode: str, mps: None
) -> None:
    args = EAGER if mode == "eager" else GRAPHS
    spec = gpu_spec(gpu_tiny_models[arch], args, **ONE_GPU)
    afd_out, plain_out, ffn = afd_and_plain(spec, prompts(16), tmp_path)
    assert_same_outputs(afd_out, plain_out, ATOL)
    log = (tmp_path / "afd.log").read_text()
    assert "AFD cuda_ipc data plane" in log, "the roles did not use cuda_ipc"
    assert ffn[("afd_steps", "ffn", "0")] > 0
