"""Every model family through the one generic role split, exact against plain vLLM.

For each family ``vllm-afd tiny-model`` writes (3 layers; layer 0 dense where
the family has dense layers), with the gate on the attention role: Mixtral 1A1F
and Qwen2-MoE 2A1F on the synchronous connector (``p2p``), Qwen3-MoE 1A2F and
GLM-4.5 2A2F on the ``async`` connector (the routed experts split over the two
FFN ranks; GLM-4.5's shared experts on FFN rank 0; Qwen3-MoE's steps in two
request-boundary stages, ``worker.stages``); the families served since,
each at 1A1F with the gate on attention (gpt-oss at 2A1F) but Cohere2-MoE, with
the gate on the FFN role. Each is compared token-for-token (and top-5 logprobs)
with one plain vLLM server of the same model and settings (fp32, eager) on 16
prompts of 1 to 200 tokens sent at once (long prefills beside decodes); Aria's
workload adds 4 chat requests with an image each (``IMAGES``). Each
deployment also proves the role split from the roles' own start-up lines: the
attention role holds no expert weights, the FFN role no attention, embedding,
norm or lm_head weights, both read the same split from what vLLM built, and an
``async`` FFN rank keeps its own half of the routed experts only. Last, one of
the Qwen3-MoE deployment's FFN ranks is killed mid-stream (``async`` has no
rejoin: every role stops, naming it), after its counters gave
``vllm-afd bench-ttft``'s per-request breakdown. DeepSeek-V2/V3 run the same split in
``test_exact_1a1f.py``, ``test_gate_on_attention.py`` and
``test_scale_out.py``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from harness import (
    FAMILY_RESULTS,
    FAULT_RESULTS,
    POOL,
    Supervisor,
    afd_vs_plain,
    assert_same_outputs,
    http_get,
    image_chats,
    kill_ffn_mid_stream,
    largest_logprob_gap,
    make_spec,
    model_lines,
    plain_outputs,
    print_log_tail,
    prompts,
    run_workload,
    served_model,
    settled_metrics,
    wait_for,
)

from vllm_afd.cli.bench_ttft import afd_counters, breakdown
from vllm_afd.models.tiny_hf import GATE_ON_ATTENTION_ARCHS

pytestmark = pytest.mark.e2e

#: family -> (MoE layers, dense layers) of its 3-layer tiny model
LAYOUTS = {
    "qwen3_moe": ([1, 2], [0]),  # mlp_only_layers=[0]
    "qwen2_moe": ([1, 2], [0]),  # shared expert with its own sigmoid gate
    "mixtral": ([0, 1, 2], []),  # router before the runner, no shared experts
    "glm4_moe": ([1, 2], [0]),  # grouped sigmoid top-k + bias, scaling 2.5
    "deepseek_v2": ([1, 2], [0]),  # MLA, softmax greedy top-k, shared experts
    "deepseek_v3": ([1, 2], [0]),  # MLA, grouped sigmoid top-k + bias
    "glm4_moe_lite": ([1, 2], [0]),  # GLM-4.7-Flash: MLA + GLM-4.5's MoE block
    "axk1": ([1, 2], [0]),  # A.X K1: DeepSeek-V3's layout in its own module
    # DeepSeek-V3's classes, the release's weight names, softmax grouped top-k
    "mistral_large_3": ([1, 2], [0]),
    "bailing_moe": ([0, 1, 2], []),  # Ling: softmax top-k, lm_head normalised
    "bailing_moe_v2": ([1, 2], [0]),  # Ling 2.0: sigmoid grouped top-k + bias
    "deepseek_moe": ([1, 2], [0]),  # DeepSeek-MoE: multi-head attention
    "sarvam_moe": ([1, 2], [0]),  # Sarvam-MoE: Ling 2.0's classes
    "sarvam_mla": ([1, 2], [0]),  # Sarvam-MLA: MLA, zero-mean score bias
    "param2moe": ([1, 2], [0]),  # Ling's names, zero-mean score bias
    # Step-3: MQA with low-rank queries; each MoE layer's shared expert beside
    # its MoE block, built as the layer's dense MLP
    "step3_text": ([1, 2], [0, 1, 2]),
    # openPangu: MLA, a score bias stored on the block, scaled MoE output
    "pangu_ultra_moe": ([1, 2], [0]),
    # openPangu Embedded: grouped-query attention with biases, Ultra's block
    "pangu_embedded": ([1, 2], [0]),
    "olmoe": ([0, 1, 2], []),  # q/k norms, softmax top-k not renormalised
    # Phi-MoE: LayerNorm, attention biases, sparsemixer top-2
    "phimoe": ([0, 1, 2], []),
    "granitemoe": ([0, 1, 2], []),  # multipliers; checkpoint router renamed
    "ernie4_5_moe": ([1, 2], [0]),  # shared expert, score bias beside the gate
    "gpt_oss": ([0, 1, 2], []),  # router with bias, expert biases, sinks
    "llama4": ([1], [0, 2]),  # every 2nd layer MoE; weight scales the input
    # Granite-MoE and a shared MLP beside the MoE block at every layer: vLLM
    # builds it as the layer's own dense MLP (on attention with the gate)
    "granitemoeshared": ([0, 1, 2], [0, 1, 2]),
    "qwen3_next": ([1, 2], [0]),  # linear attention mixed in; gated shared
    "exaone_moe": ([1, 2], [0]),  # shared expert, score bias held by the block
    "cohere2_moe": ([1, 2], [0]),  # LayerNorm; shared and routed averaged
    # a dense MLP beside the experts at every layer, the router in the layer
    "gemma4": ([0, 1, 2], [0, 1, 2]),
    "mimo_v2": ([1, 2], [0]),  # sliding layers with sinks; bias on the gate
    "hy_v3": ([1, 2], [0]),  # shared expert, score bias held by the block
    # AFMoE: shared expert, score bias held by the block, gated attention
    "afmoe": ([1, 2], [0]),
    # Aria's text model: a router weight held by the block, fused experts
    "aria": ([0, 1, 2], []),
}

#: each family's routed experts (``vllm-afd tiny-model``)
EXPERTS = {
    "qwen3_moe": 8, "qwen2_moe": 8, "mixtral": 8, "glm4_moe": 16,
    "deepseek_v2": 8, "deepseek_v3": 16, "glm4_moe_lite": 16, "olmoe": 8,
    "granitemoe": 8, "ernie4_5_moe": 8, "gpt_oss": 8, "llama4": 8,
    "granitemoeshared": 8, "qwen3_next": 8, "exaone_moe": 8, "cohere2_moe": 8,
    "gemma4": 8, "mimo_v2": 8, "hy_v3": 8, "axk1": 16,
    "mistral_large_3": 16, "bailing_moe": 8, "bailing_moe_v2": 16,
    "deepseek_moe": 8, "sarvam_moe": 8, "sarvam_mla": 16, "param2moe": 16,
    "step3_text": 8, "pangu_ultra_moe": 16, "pangu_embedded": 8, "aria": 8,
    "phimoe": 8, "afmoe": 8,
}  # fmt: skip
#: families whose MoE layers have shared experts
SHARED = (
    "qwen2_moe", "glm4_moe", "deepseek_v2", "deepseek_v3", "glm4_moe_lite",
    "ernie4_5_moe", "llama4", "qwen3_next", "exaone_moe", "cohere2_moe", "hy_v3",
    "axk1", "mistral_large_3", "bailing_moe", "bailing_moe_v2", "deepseek_moe",
    "sarvam_moe", "sarvam_mla", "param2moe", "pangu_ultra_moe", "pangu_embedded",
    "aria", "afmoe",
)  # fmt: skip
#: families served in another dtype than fp32 on CPU: vLLM's CPU kernel of
#: Qwen3-Next's gated delta-net attention asserts "CPU GDN attention requires
#: BF16" (plain vLLM too)
DTYPES = {"qwen3_next": "bfloat16"}
#: families whose releases ship their config class as code of their own
#: (``auto_map``): every server loads them with ``--trust-remote-code``
REMOTE_CODE = (
    "bailing_moe", "bailing_moe_v2", "deepseek_moe", "sarvam_moe", "sarvam_mla",
    "param2moe", "pangu_ultra_moe", "pangu_embedded",
)  # fmt: skip
#: multimodal families whose workload adds chat requests with an image each
#: (``harness.image_chats``), sent with the text prompts: the vision tower and
#: projector run on the attention role, which sends the text model's hidden
#: states of the image tokens as of any other
IMAGES = {"aria": 4}

# (family, attention ranks, FFN ranks, gate on attention, connector): every
# family with the gate on the attention role, where the split is the family's
# own (its router taken out of the MoE block, routing payloads sent): two on
# the synchronous connector, one of them (Qwen2-MoE: a shared expert with its
# own gate) with two attention ranks merged on the FFN (routing payloads of two
# ranks); two on the async one, experts split over two FFN ranks. With the gate
# on the FFN role the FFN runs the family's MoE block as vLLM built it:
# Cohere2-MoE here (its router runs before the fused-MoE runner, its block
# changes the runner's output after it), Qwen3-MoE in test_faults.py (1A1F,
# 2A1F) and test_multi_host.py, DeepSeek-V2/V3 in test_exact_1a1f.py. The merge
# itself is family-independent (tests/connector contract suite, 2A1F in
# test_faults.py).
CASES = [
    ("mixtral", 1, 1, True, "p2p"),
    ("qwen2_moe", 2, 1, True, "p2p"),
    # the families served since: each at 1A1F with its router on attention;
    # gpt-oss (expert biases, clamped SwiGLU, attention sinks, sliding
    # windows) at 2A1F
    ("glm4_moe_lite", 1, 1, True, "p2p"),
    ("axk1", 1, 1, True, "p2p"),
    ("mistral_large_3", 1, 1, True, "p2p"),
    ("bailing_moe_v2", 1, 1, True, "p2p"),
    ("bailing_moe", 1, 1, True, "p2p"),
    ("deepseek_moe", 1, 1, True, "p2p"),
    ("sarvam_moe", 1, 1, True, "p2p"),
    ("sarvam_mla", 1, 1, True, "p2p"),
    ("param2moe", 1, 1, True, "p2p"),
    ("step3_text", 1, 1, True, "p2p"),
    ("pangu_ultra_moe", 1, 1, True, "p2p"),
    ("pangu_embedded", 1, 1, True, "p2p"),
    ("olmoe", 1, 1, True, "p2p"),
    ("phimoe", 1, 1, True, "p2p"),
    ("granitemoe", 1, 1, True, "p2p"),
    ("ernie4_5_moe", 1, 1, True, "p2p"),
    ("gpt_oss", 2, 1, True, "p2p"),
    ("llama4", 1, 1, True, "p2p"),
    ("granitemoeshared", 1, 1, True, "p2p"),
    ("qwen3_next", 1, 1, True, "p2p"),
    ("exaone_moe", 1, 1, True, "p2p"),
    # gate on FFN: the router before the runner, the block's tail after it
    # (``block_tail``: the FFN returns the MoE layer's output, attention's
    # block averages it with the shared expert's)
    ("cohere2_moe", 1, 1, False, "p2p"),
    ("gemma4", 1, 1, True, "p2p"),
    ("mimo_v2", 1, 1, True, "p2p"),
    ("hy_v3", 1, 1, True, "p2p"),
    ("afmoe", 1, 1, True, "p2p"),
    ("aria", 1, 1, True, "p2p"),
    ("glm4_moe", 2, 2, True, "async"),
    # expert biases cut with the weights; its loader handed each all-expert
    # tensor's rows of the rank's slice (``Family.whole_expert_tensors``)
    ("gpt_oss", 1, 2, True, "async"),
    # with request-boundary stages (afd.num_ubatches 2): most steps split;
    # payloads in shared-memory slot rings (connector option payload: shared)
    ("qwen3_moe", 1, 2, True, "async+shared+stages"),  # last: the fault test ends it
]
#: vLLM's micro-batch thresholds on the staged case's attention role, low
#: enough that the decode steps of this workload are split too
STAGE_ARGS = [
    "--dbo-prefill-token-threshold",
    "64",
    "--dbo-decode-token-threshold",
    "4",
]
# AFD_TEST_ASYNC_FAMILIES=1: every family on the async connector at 2A2F too
# (outside CI's time budget; docs/prefill.md quotes a run)
if os.environ.get("AFD_TEST_ASYNC_FAMILIES") == "1":
    CASES += [(f, 2, 2, True, "async") for f in LAYOUTS if f != "glm4_moe"]
# AFD_TEST_FAMILY_GATES=1: every family with its gate on the FFN role too, at
# 1A1F (outside CI's time budget; docs/models.md says which ran)
if os.environ.get("AFD_TEST_FAMILY_GATES") == "1":
    CASES += [
        (f, 1, 1, False, "p2p")
        for f in LAYOUTS
        if f != "cohere2_moe" and f not in GATE_ON_ATTENTION_ARCHS
    ] + [("cohere2_moe", 1, 1, True, "p2p")]


#: the default ``timeout_s`` (docs/configuration.md): a SIGKILLed FFN rank's
#: sockets close at once, so the loss is seen well within it
ASYNC_TIMEOUT_S = 60.0


def _atol(attention_ranks: int, ffn_ranks: int) -> float:
    """The logprob tolerance of a case. 1A1F: none, bit for bit: its
    requests are admitted together (``afd_vs_plain``), so every step holds
    the rows plain vLLM's holds, in the same order, and the split computes
    what plain vLLM computes. More ranks: 1e-4. With 2 attention ranks the
    FFN's merged batch holds other rows than plain vLLM's one batch (see
    test_scale_out.py); with experts split over FFN ranks the attention rank
    adds their partial sums (another order of the same sum); token ids must
    still be identical."""
    if attention_ranks == ffn_ranks == 1:
        return 0.0
    return 1e-4


IDS = [
    f"{f}-{a}A{n}F-{c}-gate_on_{'attention' if g else 'ffn'}" for f, a, n, g, c in CASES
]


def _next_spec(request, family_models, case: tuple):
    """The next case's spec, when the session runs it (its deployment starts
    beside this case's work: ``afd_vs_plain(then=...)``), else None."""
    at = CASES.index(case) + 1
    if at < len(CASES) and any(
        item.nodeid.endswith(f"[{IDS[at]}]") for item in request.session.items
    ):
        family, ranks, ffn_ranks, gate, connector = CASES[at]
        return _spec(family_models[family], ranks, ffn_ranks, gate, connector)
    return None


@pytest.mark.parametrize(
    "family,ranks,ffn_ranks,gate_on_attention,connector", CASES, ids=IDS
)
def test_family_exact_and_role_split(
    request, family_models, family, ranks, ffn_ranks, gate_on_attention, connector
):
    case = (family, ranks, ffn_ranks, gate_on_attention, connector)
    spec = _spec(family_models[family], ranks, ffn_ranks, gate_on_attention, connector)
    # test_faults.py and test_multi_host.py's workload, images added
    text_prompts = prompts(16)
    texts = [*text_prompts, *image_chats(IMAGES.get(family, 0))]
    # plain vLLM once per family (harness); the next case starts meanwhile
    staged = "stages" in connector.split("+")
    run = afd_vs_plain(
        spec,
        texts,
        metrics="attention" if staged else None,
        then=_next_spec(request, family_models, case),
    )
    same = sum(
        a.token_ids == p.token_ids for a, p in zip(run.afd, run.plain, strict=True)
    )
    lines = model_lines(run.log)
    held = {
        role: {g: b for g, b in groups.items() if b}
        for role, (_, groups) in lines.items()
    }
    n = len(text_prompts)
    images = sum(
        a.token_ids == p.token_ids
        for a, p in zip(run.afd[n:], run.plain[n:], strict=True)
    )
    with_images = (
        f" ({images}/{len(texts) - n} with an image, logprobs within "
        f"{largest_logprob_gap(run.afd[n:], run.plain[n:]):.3g})"
    ) * (len(texts) > n)
    FAMILY_RESULTS.append(
        f"{family} {ranks}A{ffn_ranks}F {connector} gate on "
        f"{'attention' if gate_on_attention else 'ffn'}: {same}/{len(texts)} "
        f"identical{with_images}, logprobs within "
        f"{largest_logprob_gap(run.afd, run.plain):.3g}; bytes {held}"
    )
    assert_same_outputs(run.afd, run.plain, atol=_atol(ranks, ffn_ranks))

    assert set(lines) == {"attention", "ffn"}, run.log[-3000:]
    (att_split, att), (ffn_split, ffn) = lines["attention"], lines["ffn"]
    assert att_split == ffn_split
    moe, dense = LAYOUTS[family]
    assert att_split["moe_layers"] == moe and att_split["dense_layers"] == dense
    remote = moe if gate_on_attention else sorted(moe + dense)
    assert att_split["remote_layers"] == remote

    # A role never holds the other role's weights.
    assert att["routed_experts"] == att["shared_experts"] == 0, att
    assert (att["gate"] > 0) == gate_on_attention, att
    assert (att["dense_mlp"] > 0) == (gate_on_attention and bool(dense)), att
    assert att["attention"] > 0 and att["embed_tokens"] > 0, att
    for group in ("embed_tokens", "lm_head", "norms", "attention"):
        assert ffn[group] == 0, (group, ffn)
    assert ffn["routed_experts"] > 0 and (ffn["gate"] > 0) != gate_on_attention
    assert (ffn["dense_mlp"] > 0) == (not gate_on_attention and bool(dense)), ffn
    assert (ffn["shared_experts"] > 0) == (family in SHARED)

    if connector.startswith("async"):
        _check_expert_slices(run.log, EXPERTS[family], ffn_ranks)
    if connector.startswith("async") and ranks > 1:
        _check_ranks_step_on_their_own(spec)
    if "shared" in connector.split("+"):  # both roles, on every link
        assert len(re.findall(r"payload shared \(2 slots of", run.log)) == 3, run.log
    if staged:
        split = run.metrics[("afd_attention_ubatched_steps", "attention", "0")]
        steps = run.metrics[("afd_steps", "attention", "0")]
        FAMILY_RESULTS.append(
            f"{family} {ranks}A{ffn_ranks}F {connector}: {split:.0f} of "
            f"{steps:.0f} steps in stages"
        )
        assert 0 < split < steps, run.metrics


def _check_ranks_step_on_their_own(spec) -> None:
    """The async connector's attention ranks run as independent engines
    (``compat.independent_ranks``): while one serves a request, the other,
    idle, takes no step (in vLLM's lockstep of an MoE model's data-parallel
    ranks it would run a dummy forward through AFD every step)."""
    afd, _ = POOL.deployment(spec)
    url = afd.api_url
    before = settled_metrics(url)
    run_workload(url, served_model(url), prompts(1))
    after = settled_metrics(url)
    steps = {
        rank: after.get(("afd_steps", "attention", str(rank)), 0.0)
        - before.get(("afd_steps", "attention", str(rank)), 0.0)
        for rank in range(spec.attention_ranks)
    }
    assert min(steps.values()) == 0 < max(steps.values()), steps


def _spec(model, ranks: int, ffn_ranks: int, gate_on_attention: bool, connector: str):
    dtype = DTYPES.get(Path(model).name, "float32")
    connector, *flags = connector.split("+")
    staged = {"ubatches": 2, "attention_args": STAGE_ARGS} if "stages" in flags else {}
    options = {"payload": "shared"} if "shared" in flags else {}
    remote = ["--trust-remote-code"] if Path(model).name in REMOTE_CODE else []
    return make_spec(
        model,
        ["--dtype", dtype, "--enforce-eager", *remote],
        attention_ranks=ranks,
        ffn_ranks=ffn_ranks,
        gate_on_attention=gate_on_attention,
        connector=connector,
        connector_extra_config=options,
        **staged,
    )


def test_async_ffn_rank_lost_fails_its_requests_and_rejoins(family_models):
    """The async Qwen3-MoE 1A2F deployment above (its last user; steps in
    two stages): FFN rank 1, whose experts are nowhere else, SIGKILLed after
    the first streamed token.
    The stream ends with an error, ``/health`` answers 503 naming ffn rank 1,
    the launcher restarts it, the attention rank and FFN rank 0 re-form the
    session with it (same processes), and the workload is exact again."""
    spec = _spec(family_models["qwen3_moe"], 1, 2, True, "async+shared+stages")
    afd, log = POOL.take(spec)
    try:
        url = afd.api_url
        name = served_model(url)
        _check_ttft_breakdown(afd)
        kept = [afd.attention.proc.pid, afd.ffns[0].proc.pid]
        with Supervisor(afd) as supervisor:
            figures = kill_ffn_mid_stream(afd, name, ASYNC_TIMEOUT_S, rank=1)
            figures["FFN restarted, healthy"] = wait_for(
                afd.ffns[1].healthy, 300, "the restarted ffn rank 1"
            )
            figures["rejoin after FFN healthy"] = wait_for(
                lambda: http_get(f"{url}/health")[0] == 200, 120, "attention /health"
            )
            assert supervisor.error is None, supervisor.error
        again = run_workload(url, name, prompts(16))
        assert [afd.attention.proc.pid, afd.ffns[0].proc.pid] == kept
    except BaseException:
        print_log_tail(log)
        raise
    finally:
        afd.stop()
    assert_same_outputs(again, plain_outputs(spec, prompts(16)), _atol(1, 2))
    FAULT_RESULTS.append(
        "1A2F async in stages, ffn rank 1 SIGKILLed mid-stream: "
        + ", ".join(f"{k} {v:.2f}s" for k, v in figures.items())
    )


def _check_ttft_breakdown(afd) -> None:
    """``vllm-afd bench-ttft``'s per-request breakdown, read from this
    deployment's counters over 4 requests: every part grows."""
    urls = [afd.api_url, *(p.url for p in afd.ffns)]
    before = afd_counters(urls)
    run_workload(afd.api_url, served_model(afd.api_url), prompts(4))

    def grown() -> bool:
        parts = breakdown(before, afd_counters(urls), 4)
        return all(v is not None and v > 0 for v in parts.values())

    wait_for(grown, 30, "the connector wait, FFN compute and A2F counters to grow")


def _check_expert_slices(log: str, experts: int, ffn_ranks: int) -> None:
    """Each async FFN rank announced its slice and kept its weights only."""
    per = experts // ffn_ranks
    want = {str(k): f"{k * per}..{(k + 1) * per - 1}" for k in range(ffn_ranks)}
    up_line = r"AFD connector up \(async\): ffn rank (\d+),.*experts (\d+\.\.\d+)"
    up = re.findall(up_line, log)
    assert dict(up) == want, up
    kept = re.findall(r"ffn rank (\d+) keeps routed experts (\d+\.\.\d+) of "
                      r"\d+: (\d+) of (\d+) bytes", log)  # fmt: skip
    assert {k: s for k, s, _, _ in kept} == want, kept
    assert all(ffn_ranks * int(k) == int(b) for _, _, k, b in kept), kept
