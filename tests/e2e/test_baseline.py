"""The baseline of every comparison, held to a plain vLLM server.

On CPU the suite computes plain vLLM's answers in one process of the session
(``harness.PLAIN_RUNNER``: the pinned vLLM's offline engine built from the
plain server's own command line) instead of starting a plain server per model
and settings. That is only a baseline if it answers as the server does: here
both answer the workload of the families test (16 prompts of 1 to 200 tokens,
32 to 64 new tokens, greedy, top-5 logprobs) on its Qwen3-MoE model, in fp32
and in bf16, the server's requests admitted together; token ids and logprobs
must be identical, bit for bit. (Sent at once to a running server, the
requests fall into steps as they arrive, and CPU GEMMs of another row count
round otherwise: 1.025e-5 in one fp32 run of three.)
"""

from __future__ import annotations

import pytest
from harness import (
    PLAIN_RUNNER,
    POOL,
    assert_same_outputs,
    make_spec,
    plain_outputs,
    prompts,
    run_workload,
    served_model,
)

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_baseline_answers_as_a_plain_vllm_server(family_models, dtype):
    spec = make_spec(family_models["qwen3_moe"], ["--dtype", dtype, "--enforce-eager"])
    texts = prompts(16)
    if not PLAIN_RUNNER.serves(POOL.plain_server(spec)):
        pytest.skip("plain baselines run as servers here (a CUDA device is visible)")
    baseline = plain_outputs(spec, texts)
    server = POOL.running(POOL.plain_server(spec, together=True))
    try:
        url = server.url
        served = run_workload(url, served_model(url), texts, log=server.log)
    finally:
        POOL.trim()
    assert_same_outputs(served, baseline, atol=0.0)
