"""Tensor parallelism on both roles on CPU, exact against plain vLLM.

Only TP rank 0 of each role joins the connector: attention rank 0 broadcasts
the F2A result to its TP group, the FFN rank broadcasts the plan and the A2F
batch, every TP rank computes its shard and vLLM's all-reduce combines them.
The baseline is one plain vLLM engine with the same TP size.
``VLLM_CPU_OMP_THREADS_BIND=0|1`` binds the two TP workers of an engine to
the two cores (vLLM's automatic binding needs one NUMA node per worker).

The M:N topologies (2A1F, 2A2F) are checked for exactness in
``test_faults.py``, in the same deployments that then lose FFN ranks. The
tiny DeepSeek-V2 in fp32, eager, keeps CI time down.
"""

from __future__ import annotations

import pytest
from harness import (
    assert_same_outputs,
    make_spec,
    plain_outputs,
    prompts,
    run_workload,
    served_model,
    start,
)

from vllm_afd.cli.client import afd_metrics

pytestmark = pytest.mark.e2e

TP2 = ["--tensor-parallel-size", "2"]

# (id, attention ranks, ffn ranks, vLLM args of every role and the baseline)
CASES = [
    # Tensor parallelism on both roles (one connector sender per TP group),
    # against plain vLLM with the same TP size.
    ("1A1F-tp2", 1, 1, TP2),
]

#: logprob tolerance with 2+ attention ranks. Token ids must be identical in
#: every case. vLLM spreads the requests over its DP ranks by load, so each
#: attention rank, and the FFN's merged batch, holds other rows than plain
#: vLLM's one batch, and CPU fp32 GEMMs of another row count may round
#: differently (~1e-6 relative): a logprob near -5 once moved 1.1e-5.
MERGED_ATOL = 1e-4

_plain_outputs: dict[tuple[str, ...], list] = {}


def _baseline(spec, texts):
    key = tuple(spec.vllm_args)
    if key not in _plain_outputs:
        _plain_outputs[key] = plain_outputs(spec, texts)
    return _plain_outputs[key]


@pytest.mark.parametrize("name,a,f,args", CASES, ids=[c[0] for c in CASES])
def test_topology_greedy_output_equals_plain_vllm(
    tiny_models, monkeypatch, name, a, f, args
):
    if "--tensor-parallel-size" in args:
        # vLLM's CPU workers of one engine need explicit core binding here.
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    spec = make_spec(
        tiny_models["deepseek_v2"],
        ["--dtype", "float32", "--enforce-eager", *args],
        attention_ranks=a,
        ffn_ranks=f,
    )
    texts = prompts(16)
    afd, _ = start(spec)
    try:
        afd_out = run_workload(afd.api_url, served_model(afd.api_url), texts)
        ffn_steps = [
            afd_metrics(p.url).get(("afd_steps", "ffn", str(k)), 0.0)
            for k, p in enumerate(afd.ffns)
        ]
    finally:
        afd.stop()
    plain_out = _baseline(spec, texts)
    assert_same_outputs(afd_out, plain_out, atol=1e-5 if a == 1 else MERGED_ATOL)
    # Every FFN rank served steps (each attention rank reaches its FFN rank).
    assert all(steps > 0 for steps in ffn_steps), ffn_steps
