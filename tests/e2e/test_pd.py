"""AFD as the decode side of prefill/decode disaggregation (``launch --prefill``).

A plain prefill server computes each prompt's KV cache (vLLM's
``ExampleConnector``, through files), the AFD decode deployment's attention
role loads it and decodes, vLLM's router sends each request to both in turn.
Through the router, greedy ids and top-5 logprobs equal plain vLLM's on the
same model and settings, at 1A1F (and 2A1F with ``AFD_TEST_PD_2A1F=1``)
behind a plain prefill server and at 1A1F behind an AFD 1A2F prefill
deployment on the ``async`` connector (``--prefill 1A2F:async``: its
attention role computes the KV cache, the experts split over its two FFN
ranks), and the decode attention role counts prompt tokens loaded from the
connector (so the KV cache did come from prefill). The requests go one after
another: with vLLM's ExampleConnector on CPU, requests that overlap on the
decode side sometimes come out otherwise, with plain vLLM as the decode side
too (docs/deployment.md).

Then, behind the plain prefill server at 1A1F, the prefill server is
SIGKILLed: requests through the router fail with
HTTP 5xx, decode keeps serving (straight to its API), the supervisor starts
prefill again, and requests through the router are exact again (``AGAIN``: four
of the requests, prefill's KV now from a new process). Each deployment serves
eight of the workload's sixteen requests (``SERVED``: prompts of 1 to 200
tokens, streamed and not); plain vLLM's outputs are the session's, for all
sixteen.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import pytest
from harness import (
    LogSink,
    Supervisor,
    assert_same_outputs,
    bindable,
    complete,
    free_ports,
    free_run,
    http_error,
    make_spec,
    plain_outputs,
    prestart_plain,
    print_log_tail,
    prompts,
    run_cli,
    wait_for,
    workload_jobs,
)
from prometheus_client.parser import text_string_to_metric_families

from vllm_afd.deploy.pd import (
    PREFILL_AFD_PORT_OFFSET,
    AFDPrefill,
    PDDeployment,
    PDSpec,
    parse_prefill,
)

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("quiet_host")]

ARGS = ["--dtype", "float32", "--enforce-eager"]
#: the decode side computes each prompt's tail beside a loaded prefix, in
#: other GEMM shapes than plain vLLM's one prefill (measured: 7.4e-6 at most)
ATOL = 1e-4
READY_TIMEOUT_S = 420.0
#: the supervisor starts a killed prefill server again within this (backoff
#: 1 s, then a start of ~30 s on two cores)
PREFILL_BACK_S = 240.0
#: the workload's requests each PD deployment serves (one after another):
#: prompts of 1, 3, 8, 34, 89, 144, 200 and 7 tokens, streamed and not
SERVED = (0, 2, 4, 7, 9, 11, 14, 15)
#: the requests sent again once prefill is back: prompts of 1, 89, 144 and
#: 200 tokens
AGAIN = (0, 9, 11, 14)
#: requests of the PD benchmark's run
BENCH_N = 6


def _pd_spec(model, attention: int, ffn: int, prefill: str = "1") -> PDSpec:
    side = parse_prefill(prefill)
    afd_prefill = isinstance(side, AFDPrefill)
    while True:
        spec = make_spec(model, ARGS, attention_ranks=attention, ffn_ranks=ffn)
        prefill_connector: set[int] = set()
        if afd_prefill:  # the prefill deployment's connector ports
            first = spec.afd_port + PREFILL_AFD_PORT_OFFSET
            prefill_connector = {first, first + 1}
        if all(bindable(p) for p in prefill_connector):
            break
    taken = {spec.port, spec.ffn_port, spec.afd_port, spec.afd_port + 1}
    taken |= prefill_connector
    router = next(p for p in free_ports(4) if p not in taken)
    # the prefill side's API ports, then the router's metrics
    ports = 1 + (side.ffn_ranks if isinstance(side, AFDPrefill) else 0) + 1
    prefill_port = free_run(ports, avoid={*taken, router})
    return PDSpec.make(
        spec, prefill=side, port=router, decode_port=spec.port,
        prefill_port=prefill_port,
    )  # fmt: skip


def one_by_one(
    url: str, model: str, texts: list[str], only: tuple[int, ...] | None = None
) -> list:
    """The workload's requests in turn (even ones streamed); ``only``: these
    of them."""
    jobs = list(enumerate(workload_jobs(texts)))
    if only is not None:
        jobs = [jobs[i] for i in only]
    return [complete(url, model, p, n, i % 2 == 0) for i, (p, n) in jobs]


def _loaded_tokens(url: str) -> float:
    """Prompt tokens the server took from its KV connector (vLLM's counter
    ``vllm:prompt_tokens_by_source{source="external_kv_transfer"}``)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "vllm:prompt_tokens_by_source_total"
        and sample.labels.get("source") == "external_kv_transfer"
    )


#: (prefill side, decode topology) of each PD deployment; AFD_TEST_PD_2A1F=1
#: adds a plain prefill server in front of AFD 2A1F (its DP attention ranks
#: are in test_families.py and test_multi_host.py, PD in the cases here)
PD_CASES = [("1", "1A1F"), ("1A2F:async", "1A1F")]
if os.environ.get("AFD_TEST_PD_2A1F") == "1":
    PD_CASES.insert(1, ("1", "2A1F"))


@pytest.mark.parametrize(
    ("prefill", "topology"),
    PD_CASES,
    ids=[f"{'1P' if p == '1' else p.replace(':', '_')}-{t}" for p, t in PD_CASES],
)
def test_pd_with_afd_decode_equals_plain_vllm(
    family_models, tmp_path, prefill, topology
):
    attention, ffn = int(topology[0]), int(topology[2])
    pd_spec = _pd_spec(family_models["qwen3_moe"], attention, ffn, prefill)
    texts = prompts()
    prestart_plain(pd_spec.decode, texts)
    log = LogSink()
    pd = PDDeployment(pd_spec, log=log, log_dir=tmp_path)
    try:
        pd.start(READY_TIMEOUT_S)
        model = pd_spec.decode.model
        out = one_by_one(pd.api_url, model, texts, only=SERVED)
        decode_url = pd.decode.api_url
        loaded = _loaded_tokens(decode_url)
        assert loaded > 0, "the decode attention role loaded no KV from prefill"
        plain = plain_outputs(pd_spec.decode, texts)
        assert_same_outputs(out, [plain[i] for i in SERVED], ATOL)
        print(f"PD {prefill}P-{topology}: {loaded:.0f} prompt tokens' KV from prefill")
        if (prefill, topology) == ("1", "1A1F"):
            _prefill_killed(pd, texts, model)
    except BaseException:
        print_log_tail(log)
        raise
    finally:
        pd.stop()
    assert not [p.name for p in pd.processes if p.exit_code() is None]


def _prefill_killed(pd: PDDeployment, texts: list[str], model: str) -> None:
    prefill = pd.prefills[0]
    assert prefill.proc is not None
    with Supervisor(pd) as sup:
        os.killpg(prefill.proc.pid, signal.SIGKILL)
        wait_for(lambda: prefill.exit_code() is not None, 30, "prefill to exit")
        body = {"model": model, "prompt": texts[9], "max_tokens": 4}
        status, text = http_error(f"{pd.api_url}/v1/completions", body, 60)
        assert status >= 500, (status, text)
        print(f"prefill down: the router answers {status}: {text[:200]}")
        # decode serves on, straight to its API
        direct = complete(pd.decode.api_url, model, texts[3], 8, stream=False)
        assert len(direct.token_ids) == 8
        t0 = time.monotonic()
        wait_for(
            lambda: prefill.restarts == 1 and prefill.healthy() or sup.error,
            PREFILL_BACK_S,
            "the supervisor to start prefill again",
        )
        assert sup.error is None, sup.error
        print(f"prefill back after {time.monotonic() - t0:.0f}s")
        again = one_by_one(pd.api_url, model, texts, only=AGAIN)
    plain = plain_outputs(pd.decode.spec, texts)
    assert_same_outputs(again, [plain[i] for i in AGAIN], ATOL)


def test_bench_pd_with_afd_decode_against_plain_decode_and_plain_vllm(
    family_models, tmp_path
):
    """``vllm-afd bench --prefill 1``: PD with AFD 1A1F decode, PD with one
    plain decode server (the baseline), plain vLLM (the reference), the same
    requests one at a time: every figure present, greedy outputs identical
    across the three, the AFD counters read from the decode roles behind the
    router."""
    port = free_run(5)  # router, decode attention, FFN, prefill, router metrics
    afd_port = free_run(3, avoid=set(range(port, port + 5)))
    report_path = tmp_path / "pd.json"
    argv = [
        "bench", "--model", str(family_models["qwen3_moe"]), "--prefill", "1",
        "--port", str(port), "--afd-port", str(afd_port),
        "--num-requests", str(BENCH_N), "--concurrency", "1",
        "--input-len", "uniform:8:64", "--output-len", "fixed:8",
        "--warmup", "1", "--skip-overhead", "--no-progress",
        "--json", str(report_path), "--", *ARGS,
    ]  # fmt: skip
    proc = run_cli(argv)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(report_path.read_text())
    cfg = report["config"]
    assert cfg["prefill"] == "1P" and cfg["afd_label"] == "PD 1P + AFD 1A1F"
    assert cfg["baseline_label"] == "PD 1P + plain decode"
    ref = report["reference"]
    # role processes: prefill + attention + FFN, prefill + decode, plain
    sides = [(report["afd"], 3), (report["baseline"], 2), (ref["figures"], 1)]
    for run, devices in sides:
        assert (run["requests"], run["failed"]) == (BENCH_N, 0), run["errors"]
        assert run["output_tokens"] == BENCH_N * 8 and run["devices"] == devices
        assert run["ttft_ms"]["p50"] > 0 and run["tpot_ms"]["p50"] > 0
    for cmp_ in (report["comparison"], ref["comparison"]):
        assert cmp_["agreement"] == 1.0, cmp_
        assert cmp_["ttft_p50_ratio"] > 0 and cmp_["throughput_ratio"] > 0
    counters = report["counters"]
    assert counters["attention_steps"] > 0 and counters["ffn_steps"] > 0
    assert "plain vLLM on the same requests" in proc.stdout
    assert "PD 1P + plain decode" in proc.stdout.splitlines()[0]
