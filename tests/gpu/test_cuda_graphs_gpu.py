"""AFD 1A1F with CUDA graphs on two GPUs equals plain vLLM with the same graphs.

Attention on GPU 0, FFN on GPU 1, NCCL data plane, bf16 tiny DeepSeek models.
The baseline is plain vLLM on GPU 0 with the same compilation settings.

* ``FULL_DECODE_ONLY`` without torch.compile (``mode`` 0): decode steps replay
  FULL graphs on the attention role and step graphs on the FFN role; prefill
  and mixed steps run eagerly. The workload's 16 requests finish at different
  steps, so decode batches of 1-16 requests replay padded graphs.
* vLLM's default (torch.compile, ``FULL_AND_PIECEWISE``): piecewise steps run
  the exchange eagerly between graph pieces, decode steps replay FULL graphs.

Each deployment also reports that its FFN replayed graphs (the
``afd_ffn_graph_replays`` counter), so a run that silently fell back to eager
fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_harness import on_devices
from harness import (
    Deployment,
    PlainServer,
    assert_same_outputs,
    make_spec,
    prompts,
    run_workload,
    served_model,
    settled_metrics,
)

pytestmark = pytest.mark.gpu

ATOL = 1e-2
COMMON = ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.2"]
FULL_DECODE_ONLY = [
    "--compilation-config",
    '{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}',
]
CASES = {
    "full-decode-only": FULL_DECODE_ONLY,
    "compiled-default": [],
}


@pytest.mark.parametrize(
    ("arch", "case"),
    [
        ("deepseek_v2", "full-decode-only"),
        ("deepseek_v3", "full-decode-only"),
        ("deepseek_v2", "compiled-default"),
    ],
)
def test_afd_with_cuda_graphs_equals_plain_vllm_with_the_same_graphs(
    gpu_tiny_models: dict[str, Path], tmp_path: Path, arch: str, case: str
) -> None:
    spec = make_spec(gpu_tiny_models[arch], [*COMMON, *CASES[case]])
    texts = prompts(16)

    with (tmp_path / "afd.log").open("w") as log:
        afd = Deployment(spec, log=log)
        on_devices(afd.attention, "0")
        on_devices(afd.ffn, "1")
        try:
            afd.start(ready_timeout=600)
            afd_out = run_workload(afd.api_url, served_model(afd.api_url), texts)
            ffn = settled_metrics(afd.ffn.url)
        finally:
            afd.stop()

    with (tmp_path / "plain.log").open("w") as log:
        plain = PlainServer(spec, log=log)
        on_devices(plain.process, "0")
        try:
            plain.start(ready_timeout=600)
            plain_out = run_workload(plain.url, served_model(plain.url), texts)
        finally:
            plain.stop()

    replays = ffn.get(("afd_ffn_graph_replays", "ffn", "0"), 0.0)
    steps = ffn.get(("afd_steps", "ffn", "0"), 0.0)
    print(f"{arch} {case}: FFN steps {steps:.0f}, replayed from graphs {replays:.0f}")
    pairs = zip(afd_out, plain_out, strict=True)
    same = sum(a.token_ids == p.token_ids for a, p in pairs)
    print(f"{arch} {case}: {same}/{len(texts)} requests token-identical")
    assert replays > 0, "the FFN replayed no CUDA graph"
    assert_same_outputs(afd_out, plain_out, ATOL)
