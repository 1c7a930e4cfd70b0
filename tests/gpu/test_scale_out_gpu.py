"""2A1F on two GPUs: both attention ranks on GPU 0, the FFN on GPU 1.

``--attention-ranks 2 --attention-devices 0 --ffn-devices 1``: the launcher
sets ``afd.attention_ranks_per_device = 2``, so vLLM's two data-parallel
attention ranks share GPU 0, and the FFN merges their tokens into one batch
per layer over two NCCL pairs. The baseline is one plain vLLM engine on
GPU 0: greedy output per request does not depend on how requests are spread
over ranks. Each attention rank runs its GEMMs on its own requests only and
the FFN on both ranks' rows, so every server runs vLLM's batch-invariant
kernels (``VLLM_BATCH_INVARIANT=1``), under which row counts change no bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_harness import GPU_ARGS, afd_and_plain, gpu_spec, same_count
from harness import assert_same_outputs, prompts

pytestmark = pytest.mark.gpu

ATOL = 1e-2
#: a fixed KV cache per rank: vLLM's memory profile would count the other
#: rank's allocations on the shared GPU as its own
SHARED_GPU_KV_CACHE = ["--kv-cache-memory-bytes", "2G"]


def test_two_attention_ranks_sharing_one_gpu_equal_plain_vllm(
    gpu_tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    spec = gpu_spec(
        gpu_tiny_models["deepseek_v2"],
        GPU_ARGS,
        attention_ranks=2,
        attention_args=SHARED_GPU_KV_CACHE,
    )
    assert spec.attention_ranks_per_device() == 2
    texts = prompts(16)
    env = {"VLLM_BATCH_INVARIANT": "1"}
    afd_out, plain_out, ffn = afd_and_plain(spec, texts, tmp_path, env)
    steps = ffn.get(("afd_steps", "ffn", "0"), 0)
    print(
        f"2A1F on GPU 0 + GPU 1: FFN steps {steps:.0f}; "
        f"{same_count(afd_out, plain_out)}/{len(texts)} requests token-identical"
    )
    assert steps > 0
    assert_same_outputs(afd_out, plain_out, ATOL)
