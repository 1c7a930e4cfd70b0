"""The attention role outlives its FFN rank on CUDA: one GPU, cuda_ipc, graphs.

Both roles on GPU 0 (MPS), FULL CUDA graphs for decode, tiny bf16 Qwen3-MoE.
The cuda_ipc data plane's device-side waits end at an abort, and the buffers
the attention role's graphs point at are its own, so one lifetime covers:

1. **FFN SIGKILL mid-stream** (after the first streamed token): the stream
   ends with an error within ``timeout_s``, ``/health`` answers 503 naming
   ``ffn rank 0``, the attention process stays up;
2. the supervisor restarts the FFN rank, the attention rank rejoins it, and
   the workload (replayed from the graphs captured before the fault) is
   token-identical to plain vLLM on the same GPU.

Both sides run vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT=1``, the
plain baseline too): 16 concurrent requests reach the engine in batches that
differ from run to run, and in bf16 a row's GEMM and fused-MoE results
otherwise depend on the batch it was computed in (two runs once differed in
1 of 16 greedy requests before any fault). With the mode on, a row's result
is the same in any batch, so the comparison holds the split and the rejoin
to exactness and not the scheduler's timing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_harness import ONE_GPU, ONE_GPU_GRAPHS, gpu_spec
from harness import (
    Supervisor,
    assert_same_outputs,
    http_get,
    kill_ffn_mid_stream,
    plain_outputs,
    print_log_tail,
    prompts,
    run_workload,
    served_model,
    start,
    wait_for,
    warm_up,
)

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(1)]

TIMEOUT_S = 10.0
GRAPHS = ONE_GPU_GRAPHS
TEXTS = prompts(16)
ATOL = 1e-2


def test_attention_survives_its_ffn_on_one_gpu_with_graphs(
    gpu_tiny_models: dict[str, Path],
    tmp_path: Path,
    mps: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")  # plain vLLM and both roles
    model = gpu_tiny_models["qwen3_moe"]
    spec = gpu_spec(
        model,
        GRAPHS,
        **ONE_GPU,
        connector_extra_config={"timeout_s": TIMEOUT_S, "heartbeat_interval_s": 1.0},
        ffn_restarts=3,
    )
    with (tmp_path / "plain.log").open("w") as plain_log:
        plain = plain_outputs(spec, TEXTS, log=plain_log, devices="0", warmup=True)
    afd, log = start(spec)
    figures = {}
    try:
        url = afd.api_url
        name = served_model(url)
        warm_up(url, TEXTS)
        assert_same_outputs(run_workload(url, name, TEXTS), plain, ATOL)
        attention_pid = afd.attention.proc.pid
        with Supervisor(afd) as supervisor:
            figures.update(kill_ffn_mid_stream(afd, name, TIMEOUT_S, 460))
            figures["FFN restarted, healthy"] = wait_for(
                afd.ffn.healthy, 300, "the restarted FFN rank"
            )
            figures["rejoin after FFN healthy"] = wait_for(
                lambda: http_get(f"{url}/health")[0] == 200, 60, "attention /health"
            )
            assert supervisor.error is None, supervisor.error
        assert_same_outputs(run_workload(url, name, TEXTS), plain, ATOL)
        assert afd.attention.proc.pid == attention_pid
        assert afd.attention.exit_code() is None
    except BaseException:
        print_log_tail(log)
        raise
    finally:
        afd.stop()
    print(
        "one-GPU cuda_ipc FULL graphs, FFN SIGKILL: "
        + ", ".join(f"{k} {v:.2f}s" for k, v in figures.items())
    )
