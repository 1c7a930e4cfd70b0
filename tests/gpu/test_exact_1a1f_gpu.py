"""AFD 1A1F on two GPUs is token-for-token identical to plain vLLM on one.

Attention on GPU 0, FFN on GPU 1 (one ``CUDA_VISIBLE_DEVICES`` per role
process), p2p connector with its NCCL data plane, ``--enforce-eager``, bf16
tiny DeepSeek-V2 and -V3 with SM90 MLA head dims. The baseline is plain
vLLM on GPU 0 with the same settings. 16 concurrent prompts of 1-200 tokens,
32-64 greedy new tokens, half streamed; top-5 logprobs compared.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_harness import GPU_ARGS, add_env, gpu_spec, nccl_ranks_seen
from harness import (
    Deployment,
    assert_same_outputs,
    plain_outputs,
    prompts,
    run_workload,
    served_model,
)

from vllm_afd.cli.client import afd_metrics

pytestmark = pytest.mark.gpu

#: bf16 logprobs agree to bf16 resolution; token ids must be identical
ATOL = 1e-2


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_afd_1a1f_two_gpus_nccl_greedy_output_equals_plain_vllm(
    gpu_tiny_models: dict[str, Path], tmp_path: Path, arch: str
) -> None:
    spec = gpu_spec(gpu_tiny_models[arch], GPU_ARGS)
    texts = prompts(16)

    afd_log = tmp_path / "afd.log"
    with afd_log.open("w") as log:
        afd = Deployment(spec, log=log)
        add_env(afd, NCCL_DEBUG="INFO")
        try:
            afd.start(ready_timeout=300)
            model = served_model(afd.api_url)
            afd_out = run_workload(afd.api_url, model, texts)
            metrics = afd_metrics(afd.api_url)
        finally:
            afd.stop()

    with (tmp_path / "plain.log").open("w") as log:
        plain_out = plain_outputs(spec, texts, log=log, devices="0")

    assert_same_outputs(afd_out, plain_out, ATOL)
    # The data plane is one NCCL communicator of the two role processes.
    assert 2 in nccl_ranks_seen(afd_log.read_text()), "no 2-rank NCCL communicator"
    assert metrics[("afd_steps", "attention", "0")] > 0
