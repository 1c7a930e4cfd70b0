"""Unit tests for ``vllm-afd bench``'s report and workload helpers; no servers."""

from __future__ import annotations

import json
import random
import sys

import pytest

from vllm_afd.cli import bench_format, plots
from vllm_afd.cli import bench_report as rep
from vllm_afd.cli.bench import model_facts
from vllm_afd.cli.bench_workload import (
    Request,
    RequestResult,
    RunResult,
    arrival_offsets,
    parse_lengths,
    run_requests,
)

HIDDEN, LAYERS, BYTES = 128, 4, 4


def _result(i: int, ids: tuple[int, ...], ttft: float = 0.1) -> RequestResult:
    return RequestResult(
        index=i,
        input_len=10 + i,
        output_len=len(ids),
        token_ids=ids,
        latency_s=ttft + 0.01 * (len(ids) - 1),
        ttft_s=ttft,
        decode_s=0.01 * (len(ids) - 1),
    )


def _counters(steps: float, tokens: float) -> dict[tuple[str, str, str], float]:
    a2f = tokens * LAYERS * HIDDEN * BYTES
    return {
        ("afd_steps", "attention", "0"): steps,
        ("afd_a2f_bytes", "attention", "0"): a2f,
        ("afd_f2a_bytes", "attention", "0"): a2f,
        ("afd_connector_wait_seconds", "attention", "0"): steps * 0.002,
        ("afd_steps", "ffn", "0"): steps,
        ("afd_ffn_tokens", "ffn", "0"): tokens,
        ("afd_ffn_compute_seconds", "ffn", "0"): steps * 0.003,
        ("afd_connector_wait_seconds", "ffn", "0"): steps * 0.001,
        ("afd_a2f_bytes", "ffn", "0"): a2f,
        ("afd_f2a_bytes", "ffn", "0"): a2f,
    }


def _model() -> dict:
    return {
        "name": "tiny",
        "num_hidden_layers": LAYERS,
        "hidden_size": HIDDEN,
        "remote_layers": list(range(LAYERS)),
        "num_remote_layers": LAYERS,
        "dtype": "float32",
        "dtype_bytes": BYTES,
        "a2f_bytes_per_token_layer": HIDDEN * BYTES,
    }


def _config() -> dict:
    return {
        "deployment": "1A1F",
        "af_ratio": "1:1",
        "connector": "p2p",
        "num_requests": 3,
        "concurrency": 2,
        "request_rate": None,
        "seed": 0,
    }


def _report(agree: bool = True) -> dict:
    afd = RunResult(
        "AFD",
        tuple(_result(i, (1, 2, 3, i), 0.2) for i in range(3)),
        duration_s=2.0,
        devices=2,
    )
    base = RunResult(
        "baseline",
        tuple(_result(i, (1, 2, 3, i if agree or i else 9)) for i in range(3)),
        duration_s=1.0,
    )
    plain = RunResult("baseline", base.requests, duration_s=0.8)
    before = _counters(5, 40)
    moved = _counters(6, 60)
    after = {k: v + moved[k] for k, v in before.items()}
    return rep.build_report(
        _config(),
        _model(),
        afd,
        base,
        rep.counter_delta(before, after),
        rep.overhead_figures(base, plain),
        [(10, 4), (11, 4), (12, 4)],
    )


# -- figures -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [([1.0], 99, 1.0), ([1.0, 2.0, 3.0, 4.0], 50, 2.5), ([0.0, 10.0], 90, 9.0)],
)
def test_percentile_interpolates_like_numpy(values, q, expected):
    assert rep.percentile(values, q) == pytest.approx(expected)


def test_distribution_empty_has_only_count():
    assert rep.distribution([]) == {"count": 0}


def test_tpot_excludes_first_token_and_single_token_requests():
    assert _result(0, (1, 2, 3)).tpot_s == pytest.approx(0.01)
    assert _result(0, (1,)).tpot_s is None


def test_counter_figures_a2f_bytes_match_tokens_layers_hidden_dtype():
    c = _report()["counters"]
    assert c["attention_steps"] == 6 and c["tokens_through_ffn"] == 60
    assert c["a2f_bytes"] == 60 * LAYERS * HIDDEN * BYTES
    assert c["a2f_bytes_per_token_layer"] == HIDDEN * BYTES == 512
    assert c["a2f_bytes_per_step"] == pytest.approx(c["a2f_bytes"] / 6)
    assert c["a2f_bytes_per_layer_step"] == pytest.approx(c["a2f_bytes"] / 6 / 4)
    assert c["batch_tokens_per_step"] == pytest.approx(10)
    assert c["connector_wait_ms_per_step"] == pytest.approx(2.0)
    assert c["ffn_compute_ms_per_step"] == pytest.approx(3.0)
    assert c["wall_ms_per_step"] == pytest.approx(2000 / 6)
    ranks = {(r["role"], r["rank"]): r for r in c["per_rank"]}
    assert ranks["attention", 0]["batch_tokens_per_step"] == pytest.approx(10)
    assert ranks["ffn", 0]["ffn_compute_ms_per_step"] == pytest.approx(3.0)


def test_counter_figures_without_counters_gives_none_not_zero_division():
    c = rep.counter_figures({}, None, None)
    assert c["a2f_bytes_per_step"] is None and c["per_rank"] == []


def test_comparison_ratios_are_afd_over_baseline():
    r = _report()
    cmp_ = r["comparison"]
    assert cmp_["throughput_ratio"] == pytest.approx(0.5)
    assert cmp_["throughput_per_device_ratio"] == pytest.approx(0.25)
    assert cmp_["ttft_p50_ratio"] == pytest.approx(2.0)
    assert r["afd"]["devices"] == 2 and r["baseline"]["devices"] == 1


@pytest.mark.parametrize(("agree", "fraction"), [(True, 1.0), (False, 2 / 3)])
def test_comparison_agreement_counts_identical_token_ids(agree, fraction):
    assert _report(agree)["comparison"]["agreement"] == pytest.approx(fraction)


def test_comparison_failed_request_counts_as_disagreement():
    ok = RunResult("b", (_result(0, (1, 2)), _result(1, (3, 4))), 1.0)
    bad = RunResult(
        "a", (_result(0, (1, 2)), RequestResult.failed(1, 5, 2, OSError("x"))), 1.0
    )
    cmp_ = rep.comparison(bad, ok, rep.run_figures(bad), rep.run_figures(ok))
    assert cmp_["agreement"] == 0.5
    assert rep.run_figures(bad)["failed"] == 1


def test_overhead_is_one_minus_streamed_over_plain_throughput():
    o = _report()["overhead"]
    assert o["throughput_overhead"] == pytest.approx(1 - 0.8 / 1.0)


def test_report_has_workload_lengths_min_median_max():
    w = _report()["workload"]
    assert (w["input_len"]["min"], w["input_len"]["median"]) == (10, 11)
    assert w["output_len"]["max"] == 4


# -- output --------------------------------------------------------------------


def test_format_table_shows_every_section():
    text = bench_format.format_table(_report())
    for needle in (
        "AFD 1A1F",
        "A:F 1:1",
        "per device",
        "TTFT p99",
        "TPOT p50",
        "A2F bytes / step",
        "per token-layer 512.0",
        "FFN compute / step",
        "greedy output = baseline",
        "3/3 = 1.000",
        "bench overhead",
        "input len 10/11/12",
    ):
        assert needle in text, needle


def test_comparison_without_baseline_has_every_key_none():
    run = RunResult("AFD", (_result(0, (1, 2)),), 1.0)
    cmp_ = rep.comparison(run, None, rep.run_figures(run), None)
    assert set(cmp_) == set(rep.COMPARISON_KEYS) and not any(cmp_.values())


def test_comparison_keys_match_ratios_computed_with_baseline():
    assert set(_report()["comparison"]) == set(rep.COMPARISON_KEYS)


def test_format_table_without_baseline_prints_dashes():
    r = _report()
    r.update(baseline=None, comparison=dict.fromkeys(rep.COMPARISON_KEYS))
    r.update(overhead=None)
    text = bench_format.format_table(r)
    assert "not measured" in text and "greedy output" not in text


def test_write_json_round_trips(tmp_path):
    r = _report()
    rep.write_json(r, tmp_path / "out" / "r.json")
    assert json.loads((tmp_path / "out" / "r.json").read_text()) == json.loads(
        json.dumps(r)
    )


@pytest.mark.parametrize("with_baseline", [True, False])
def test_plot_report_writes_png_when_matplotlib_present(tmp_path, with_baseline):
    pytest.importorskip("matplotlib")
    r = _report()
    if not with_baseline:
        r.update(baseline=None, comparison=dict.fromkeys(rep.COMPARISON_KEYS))
    path = plots.plot_report(r, tmp_path)
    assert path is not None and path.read_bytes()[:4] == b"\x89PNG"


def test_plot_report_returns_none_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises
    assert plots.plot_report(_report(), tmp_path) is None
    assert not list(tmp_path.iterdir())


# -- workload ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "lo", "hi"),
    [("fixed:16", 16, 16), ("uniform:8:64", 8, 64), ("uniform:5:5", 5, 5)],
)
def test_parse_lengths_samples_within_bounds(spec, lo, hi):
    values = parse_lengths(spec, "input_len").sample(200, random.Random(0))
    assert min(values) >= lo and max(values) <= hi


def test_parse_lengths_jsonl_replays_in_order(tmp_path):
    path = tmp_path / "lens.jsonl"
    path.write_text('{"input_len": 3, "output_len": 7}\n5\n\n')
    dist = parse_lengths(f"jsonl:{path}", "input_len")
    assert dist.sample(5, random.Random(0)) == [3, 5, 3, 5, 3]


@pytest.mark.parametrize(
    "spec", ["16", "fixed:x", "uniform:9:3", "normal:1", "fixed:0"]
)
def test_parse_lengths_rejects_bad_spec_naming_it(spec):
    with pytest.raises(ValueError, match=f"length distribution {spec!r}"):
        parse_lengths(spec, "input_len")


def test_arrival_offsets_poisson_is_seeded_and_increasing():
    a, b = arrival_offsets(50, 10.0, 1), arrival_offsets(50, 10.0, 1)
    assert a == b and a == sorted(a) and a[0] == 0.0
    assert 2.0 < a[-1] < 10.0  # ~4.9 s for 49 gaps at 10/s
    assert arrival_offsets(3, None, 0) == [0.0, 0.0, 0.0]


def test_run_requests_caps_concurrency_and_keeps_order():
    import threading
    import time

    live, peak, lock = [0], [0], threading.Lock()

    def send(url, model, req, stream):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(0.02)
        with lock:
            live[0] -= 1
        return _result(req.index, req.prompt)

    reqs = [Request(i, (i, i + 1), 2) for i in range(8)]
    run = run_requests(
        "x", "u", "m", reqs, concurrency=3, rate=None, seed=0, progress=False, send=send
    )
    assert peak[0] == 3
    assert [r.index for r in run.requests] == list(range(8))
    assert run.output_tokens == 16


def _split(remote, top_k=2):
    return {
        "num_layers": 4,
        "hidden_size": 128,
        "remote_layers": remote,
        "top_k": top_k,
    }


def test_model_facts_takes_layers_from_the_split_and_dtype_from_config(tmp_path):
    cfg = {"num_hidden_layers": 4, "hidden_size": 128, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    facts = model_facts(
        str(tmp_path), "x", ["--dtype", "float32"], False, _split([0, 1, 2, 3])
    )
    assert facts["remote_layers"] == [0, 1, 2, 3]
    assert facts["a2f_bytes_per_token_layer"] == 512
    gated = model_facts(str(tmp_path), "x", [], True, _split([1, 2, 3], top_k=2))
    assert gated["remote_layers"] == [1, 2, 3] and gated["dtype"] == "bfloat16"
    assert gated["a2f_bytes_per_token_layer"] == 128 * 2 + 2 * 8


def test_model_facts_without_split_leaves_remote_layers_out(tmp_path):
    cfg = {"num_hidden_layers": 4, "hidden_size": 64, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    facts = model_facts(str(tmp_path), "x", [], False)
    assert "remote_layers" not in facts and facts["num_hidden_layers"] == 4
    assert facts["a2f_bytes_per_token_layer"] == 64 * 4


def test_log_tail_reads_the_attention_roles_split_line():
    from vllm_afd.cli.bench import LogTail

    tail = LogTail(None)
    tail.write(
        '[ffn] AFD ffn model: split {"remote_layers": [9]}; parameter '
        'bytes by group {"gate": 1}\n'
    )
    tail.write(
        '[attention] INFO AFD attention model: split {"remote_layers": '
        '[0, 1]}; parameter bytes by group {"gate": 0}\n'
    )
    assert tail.split == {"remote_layers": [0, 1]}


# -- what a user can trust -----------------------------------------------------


def test_distribution_says_when_it_rests_on_few_samples():
    assert rep.distribution([1.0] * (rep.MIN_SAMPLES - 1))["few_samples"] is True
    assert rep.distribution([1.0] * rep.MIN_SAMPLES)["few_samples"] is False


def test_table_marks_percentiles_over_few_requests_and_says_what_it_means():
    text = bench_format.format_table(_report())  # 3 requests per side
    row = next(line for line in text.splitlines() if line.startswith("TPOT p50"))
    assert row.count("~") == 2, row
    assert f"~: a percentile over fewer than {rep.MIN_SAMPLES} requests" in text


def test_overhead_sits_beside_the_throughput_it_lowers():
    lines = bench_format.format_table(_report()).splitlines()
    at = next(i for i, line in enumerate(lines) if "per device (tok/s)" in line)
    assert "bench overhead (streaming)" in lines[at + 1]
    assert "+20.0% of it" in lines[at + 1]


def test_repeats_report_median_and_spread_of_each_side_and_ratio():
    def run(name: str, duration: float) -> RunResult:
        reqs = tuple(_result(i, (1, 2, 3, i), 0.2) for i in range(3))
        return RunResult(name, reqs, duration_s=duration)

    afd = [run("AFD", d) for d in (1.0, 2.0, 4.0)]
    base = [run("baseline", d) for d in (1.0, 1.0, 2.0)]
    r = rep.repeat_figures(afd, base)
    tput = r["output_throughput"]
    tokens = afd[0].output_tokens
    assert r["count"] == 3
    assert tput["afd"]["median"] == tokens / 2.0
    assert (tput["afd"]["min"], tput["afd"]["max"]) == (tokens / 4.0, tokens / 1.0)
    assert tput["ratio"]["values"] == [1.0, 0.5, 0.5]
    assert rep.repeat_figures(afd[:1], base[:1]) is None
    report = _report()
    report["repeats"] = r
    assert "repeats: 3 runs per side, median [min, max]" in bench_format.format_table(
        report
    )


def test_provenance_records_versions_device_command_and_time():
    p = rep.provenance(["vllm-afd", "bench", "--model", "m"])
    assert p["vllm_afd"] and p["torch"] and p["vllm"]
    assert p["argv"] == ["vllm-afd", "bench", "--model", "m"]
    assert p["device"] and p["host"] and p["time_utc"].endswith("+00:00")
    report = _report()
    report["provenance"] = p
    assert f"vllm-afd {p['vllm_afd']}" in bench_format.format_table(report)


def test_a_streamed_request_records_the_gap_before_each_token() -> None:
    """Token gaps as ``plan`` times decode steps by them: none for the first
    chunk, k equal gaps for a chunk of k tokens; the request carries its
    cache salt."""
    import http.server
    import threading
    import time

    from vllm_afd.cli.bench_workload import timed_request

    bodies: list[dict] = []

    class Stream(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            bodies.append(
                json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            )
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for ids in ((1,), (2,), (3, 4)):
                tokens = [f"token_id:{i}" for i in ids]
                chunk = {"choices": [{"logprobs": {"tokens": tokens}}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.05)
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        res = timed_request(url, "m", Request(0, (5, 6), 4, salt="s1"), stream=True)
    finally:
        server.shutdown()
    assert res.error is None and res.token_ids == (1, 2, 3, 4)
    assert len(res.token_gaps_s) == 3  # tokens 2, 3 and 4
    one, half, other_half = res.token_gaps_s
    # the server sleeps 50 ms between chunks; the client reads each chunk's
    # arrival, which can come a little sooner or later than that
    assert one > 0.03 and half == other_half and 2 * half > 0.03
    assert bodies[0]["cache_salt"] == "s1"


def test_a_reference_server_gets_its_figures_and_ratios_under_the_table():
    r = _report()
    afd = RunResult("AFD", tuple(_result(i, (1, 2, 3, i), 0.2) for i in range(3)), 2.0)
    ref = RunResult(
        "reference", tuple(_result(i, (1, 2, 3, i), 0.4) for i in range(3)), 4.0
    )
    r["reference"] = rep.reference_figures(afd, ref)
    r["config"].update(
        prefill="1P",
        afd_label="PD 1P + AFD 1A1F",
        baseline_label="PD 1P + plain decode",
        reference_label="plain vLLM",
    )
    cmp_ = r["reference"]["comparison"]
    assert cmp_["ttft_p50_ratio"] == pytest.approx(0.5)
    assert cmp_["throughput_ratio"] == pytest.approx(2.0)
    text = bench_format.format_table(r)
    head = text.splitlines()[0]
    assert "vs PD 1P + plain decode, and plain vLLM" in head
    assert "PD 1P + AFD 1A1F" in text and "PD 1P + plain decode" in text
    assert "plain vLLM on the same requests: 3/3 ok" in text
    assert "(AFD/plain vLLM 2.000)" in text
    assert "TTFT p50 ~400.00 ms (0.500)" in text
    assert "greedy output = plain vLLM: 3/3" in text


def test_without_a_reference_the_table_has_no_reference_lines():
    assert "on the same requests" not in bench_format.format_table(_report())


def test_plot_names_its_runs_as_the_table_does():
    cfg = _report()["config"]
    assert plots.run_names(cfg) == (f"AFD {cfg['deployment']}", "plain vLLM")
    pd = dict(cfg, afd_label="PD 1P + AFD 1A1F", baseline_label="PD 1P + plain decode")
    assert plots.run_names(pd) == ("PD 1P + AFD 1A1F", "PD 1P + plain decode")


def _error_server(status: int, stream_error: dict | None, body: dict | None):
    """A stub HTTP server that answers like vLLM does when a request fails:
    with ``status`` and ``body``, or with a 200 stream whose second event is
    ``stream_error``."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            if body is not None:
                self.wfile.write(json.dumps(body).encode())
                return
            choice = {"text": "a", "logprobs": {"tokens": ["token_id:1"]}}
            chunk = {"choices": [choice]}
            for event in (chunk, stream_error):
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _vllm_error(message: str, code: int) -> dict:
    """The error body vLLM itself builds (its ErrorResponse model)."""
    from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

    info = ErrorInfo(message=message, type="InternalServerError", code=code)
    return ErrorResponse(error=info).model_dump()


@pytest.mark.parametrize(
    "where,stream", [("status", False), ("status", True), ("stream event", True)]
)
def test_a_failed_request_carries_the_servers_message(where: str, stream: bool):
    """A 503 of an attention server whose FFN rank is missing, or an error
    event in a stream that had started, is reported with the server's own
    message (before, a stream's error event read as ``KeyError: 'choices'``)."""
    from vllm_afd.cli.bench_workload import timed_request
    from vllm_afd.cli.client import ServerError, stream_complete

    message = "AFD: the FFN role is unavailable: ffn rank 0"
    if where == "status":
        server = _error_server(503, None, _vllm_error(message, 503))
    else:
        server = _error_server(200, _vllm_error(message, 500), None)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        res = timed_request(url, "m", Request(0, (5, 6), 4), stream=stream)
        with pytest.raises(ServerError, match=message):
            stream_complete(url, "m", "p", 4)
    finally:
        server.shutdown()
    assert res.error is not None and message in res.error
    expected = "HTTP 503: " if where == "status" else "ended the stream with an error"
    assert expected in res.error and "KeyError" not in res.error
