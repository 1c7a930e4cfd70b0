"""M:N topologies and FFN-side parallelism on CPU, each exact against plain vLLM.

Attention ranks are vLLM data-parallel ranks of one attention server (vLLM
keeps them in lockstep; idle ranks run dummy steps), FFN ranks are separate
servers (``afd.rank``). Each FFN rank merges its peers' tokens into one batch
per layer and returns each its slice. Greedy output per request does not
depend on how requests are spread over ranks, so the baseline is one plain
vLLM engine with the same model and settings (same TP size).

All cases use the tiny DeepSeek-V2 in fp32, eager, to keep CI time down.
"""

from __future__ import annotations

import pytest
from harness import (
    Deployment,
    PlainServer,
    assert_same_outputs,
    make_spec,
    prompts,
    run_workload,
    served_model,
)

from vllm_afd.cli.client import afd_metrics

pytestmark = pytest.mark.e2e

# (id, attention ranks, ffn ranks, attention args, ffn args, baseline args)
CASES = [
    ("2A1F", 2, 1, [], [], []),
    ("2A2F", 2, 2, [], [], []),
    ("1A1F-ffn-tp2", 1, 1, [], ["--tensor-parallel-size", "2"], []),
]

_plain_outputs: dict[tuple[str, ...], list] = {}


def _baseline(tiny_models, spec, baseline_args, texts):
    key = tuple(baseline_args)
    if key not in _plain_outputs:
        plain = PlainServer(spec, log=None)
        plain.process.argv += baseline_args
        plain.start()
        try:
            _plain_outputs[key] = run_workload(
                plain.url, served_model(plain.url), texts
            )
        finally:
            plain.stop()
    return _plain_outputs[key]


@pytest.mark.parametrize(
    "name,a,f,attention_args,ffn_args,baseline_args", CASES, ids=[c[0] for c in CASES]
)
def test_topology_greedy_output_equals_plain_vllm(
    tiny_models, name, a, f, attention_args, ffn_args, baseline_args
):
    spec = make_spec(
        tiny_models["deepseek_v2"],
        ["--dtype", "float32", "--enforce-eager"],
        attention_ranks=a,
        ffn_ranks=f,
        attention_args=attention_args,
        ffn_args=ffn_args,
    )
    texts = prompts(16)
    afd = Deployment(spec, log=None)
    afd.start()
    try:
        afd_out = run_workload(afd.api_url, served_model(afd.api_url), texts)
        ffn_steps = [
            afd_metrics(p.url).get(("afd_steps", "ffn", str(k)), 0.0)
            for k, p in enumerate(afd.ffns)
        ]
    finally:
        afd.stop()
    plain_out = _baseline(tiny_models, spec, baseline_args, texts)
    assert_same_outputs(afd_out, plain_out, atol=1e-5)
    # Every FFN rank served steps (each attention rank reaches its FFN rank).
    assert all(steps > 0 for steps in ffn_steps), ffn_steps
