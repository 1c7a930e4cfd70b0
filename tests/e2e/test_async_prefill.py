"""The ``async`` connector end to end: experts split over FFN ranks, exact.

Real ``vllm serve`` roles under ``vllm-afd launch --connector async``, the
16-prompt workload of test_families.py (prompts of 1 to 200 tokens, all at
once, 32-64 new tokens each: long prefills beside decodes), compared
token-for-token and by top-5 logprobs with the same plain vLLM baseline
(fp32, eager; computed once per session per family):

* Qwen3-MoE 1A2F: no shared experts, 8 experts split 4 + 4;
* GLM-4.5 2A2F: 16 experts split 8 + 8, shared experts (on FFN rank 0,
  which gets every row),
  grouped sigmoid top-k with a correction bias and routed scaling 2.5, two
  attention ranks sending to both FFN ranks.

Each FFN rank announces its expert slice, and refuses a row routed to an
expert outside it (``connector.async_ep``), so an exact output with both
ranks serving items means each ran its own slice.
"""

from __future__ import annotations

import re

import pytest
from harness import (
    FAMILY_RESULTS,
    afd_vs_plain,
    assert_same_outputs,
    make_spec,
    prompts,
)

pytestmark = pytest.mark.e2e

#: (family, attention ranks, FFN ranks)
CASES = [("qwen3_moe", 1, 2), ("glm4_moe", 2, 2)]
#: each family's routed experts (``vllm-afd tiny-model``)
EXPERTS = {"qwen3_moe": 8, "glm4_moe": 16}

#: several FFN ranks add the partial sums of their experts: the same sum in
#: another order (CPU fp32), so logprobs may differ in the last bits
ATOL = 1e-4


@pytest.mark.parametrize(
    "family,a,f", CASES, ids=[f"{fam}-{a}A{f}F" for fam, a, f in CASES]
)
def test_async_experts_split_exact(family_models, family, a, f):
    spec = make_spec(
        family_models[family],
        ["--dtype", "float32", "--enforce-eager"],
        attention_ranks=a,
        ffn_ranks=f,
        connector="async",
    )
    texts = prompts(16)
    run = afd_vs_plain(spec, texts)
    same = sum(
        x.token_ids == p.token_ids for x, p in zip(run.afd, run.plain, strict=True)
    )
    slices = dict(
        re.findall(r"AFD async connector up: ffn rank (\d+),.*experts (\d+\.\.\d+)",
                   run.log)
    )  # fmt: skip
    FAMILY_RESULTS.append(
        f"{family} {a}A{f}F async: {same}/{len(texts)} identical; expert slices "
        f"{slices}"
    )
    assert_same_outputs(run.afd, run.plain, atol=ATOL)
    half = EXPERTS[family] // 2
    assert slices == {"0": f"0..{half - 1}", "1": f"{half}..{2 * half - 1}"}
    sent = run.metrics.get(("afd_a2f_bytes", "attention", "0"), 0)
    assert sent > 0, run.metrics
