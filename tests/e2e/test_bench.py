"""``vllm-afd bench`` end to end: AFD 1A1F and plain vLLM on a tiny model.

One bench run in launcher mode (AFD, then the baseline, on this machine);
the JSON report must hold every figure with sane values: A2F bytes equal to
tokens x remote layers x hidden x 4 (fp32), greedy outputs identical to the
baseline, positive ratios. Meanwhile a poller reads ``/metrics`` of both AFD
roles and must see their counters grow across the requests.
"""

from __future__ import annotations

import json
import threading
import urllib.error

import pytest
from harness import free_ports, run_cli

from vllm_afd.cli.client import afd_metrics
from vllm_afd.deploy.cpu_mla import cpu_mla_args

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("quiet_host")]

HIDDEN, LAYERS, FP32 = 128, 4, 4
N, OUT, IN_LO, IN_HI = 8, 16, 8, 64


class MetricsPoller:
    """Reads ``afd_steps`` of both roles every 0.2 s while the bench runs."""

    def __init__(self, attention_url: str, ffn_url: str) -> None:
        self.urls = {"attention": attention_url, "ffn": ffn_url}
        self.seen: dict[str, list[float]] = {"attention": [], "ffn": []}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for role, url in self.urls.items():
                try:
                    value = afd_metrics(url).get(("afd_steps", role, "0"))
                except (urllib.error.URLError, OSError):
                    continue  # not started yet, or stopped
                if value is not None:
                    self.seen[role].append(value)

    def __enter__(self) -> MetricsPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def _check_distribution(dist: dict, lo: float = 0.0) -> None:
    assert dist["count"] > 0
    assert lo < dist["p50"] <= dist["p90"] <= dist["p99"] <= dist["max"]


@pytest.fixture(scope="module")
def bench_run(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    port, ffn_port, afd_port = free_ports(3)
    argv = [
        "bench",
        "--model",
        str(tiny_models["deepseek_v2"]),
        *("--port", str(port), "--ffn-port", str(ffn_port)),
        *("--afd-port", str(afd_port)),
        *("--num-requests", str(N), "--concurrency", "4"),
        *("--input-len", f"uniform:{IN_LO}:{IN_HI}", "--output-len", f"fixed:{OUT}"),
        *("--seed", "1", "--repeats", "2", "--json", str(out / "report.json")),
        *("--plot-dir", str(out / "plots"), "--server-log", str(out / "servers.log")),
        "--",
        *("--enforce-eager", "--max-model-len", "512", "--dtype", "float32"),
        *cpu_mla_args(tiny_models["deepseek_v2"]),
    ]
    base = f"http://127.0.0.1:{port}"
    with MetricsPoller(base, f"http://127.0.0.1:{ffn_port}") as poller:
        proc = run_cli(argv)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    return report, proc, poller, out


def test_bench_report_has_every_figure_with_sane_values(bench_run):
    report, proc, _, out = bench_run
    cfg, model, work = report["config"], report["model"], report["workload"]
    assert (cfg["af_ratio"], cfg["attention_ranks"], cfg["ffn_ranks"]) == ("1:1", 1, 1)
    assert model["num_hidden_layers"] == model["num_remote_layers"] == LAYERS
    assert model["hidden_size"] == HIDDEN and model["dtype"] == "float32"
    assert IN_LO <= work["input_len"]["min"] <= work["input_len"]["max"] <= IN_HI
    assert work["output_len"]["min"] == work["output_len"]["max"] == OUT

    for name, devices in (("afd", 2), ("baseline", 1)):
        run = report[name]
        assert (run["requests"], run["failed"]) == (N, 0), run["errors"]
        assert run["output_tokens"] == N * OUT
        assert run["output_throughput"] > 0 and run["devices"] == devices
        assert run["throughput_per_device"] == pytest.approx(
            run["output_throughput"] / devices
        )
        _check_distribution(run["ttft_ms"])
        _check_distribution(run["tpot_ms"])

    cmp_ = report["comparison"]
    assert cmp_["agreement"] == 1.0 and cmp_["agreeing_requests"] == N
    for key in ("throughput_ratio", "throughput_per_device_ratio"):
        assert cmp_[key] > 0
    for q in (50, 90, 99):
        assert cmp_[f"ttft_p{q}_ratio"] > 0 and cmp_[f"tpot_p{q}_ratio"] > 0
    assert all(row["same_output"] for row in report["requests"])

    overhead = report["overhead"]
    assert overhead["streamed_throughput"] > 0 and overhead["plain_throughput"] > 0
    assert overhead["throughput_overhead"] is not None

    assert "AFD/baseline" in proc.stdout and "bench overhead" in proc.stdout

    # What a user can trust: two runs per side with their spread, the
    # percentiles of 8 requests marked as resting on few samples, and what
    # it was measured on.
    rep = report["repeats"]
    assert rep["count"] == 2 and cfg["repeats"] == 2
    tput = rep["output_throughput"]
    assert len(tput["afd"]["values"]) == len(tput["baseline"]["values"]) == 2
    assert tput["afd"]["min"] <= tput["afd"]["median"] <= tput["afd"]["max"]
    assert tput["ratio"]["median"] > 0
    assert report["afd"]["tpot_ms"]["few_samples"] is True
    assert "repeats: 2 runs per side" in proc.stdout and "~" in proc.stdout
    prov = report["provenance"]
    assert prov["vllm"] == "0.32.0" and prov["vllm_afd"] and prov["torch"]
    assert prov["argv"][:2] == ["vllm-afd", "bench"] and "--repeats" in prov["argv"]
    assert prov["device"] and prov["time_utc"]
    png = out / "plots" / "bench.png"
    if png.exists():  # matplotlib is optional
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_bench_a2f_bytes_are_tokens_times_layers_times_hidden_fp32(bench_run):
    report = bench_run[0]
    c = report["counters"]
    steps, tokens = c["attention_steps"], c["tokens_through_ffn"]
    assert steps > 0 and c["ffn_steps"] == steps
    # Every decode step after the first token runs N requests' tokens; prefill
    # adds at most the prompts (fewer with prefix-cache hits).
    prompts = sum(row["input_len"] for row in report["requests"])
    assert N * (OUT - 1) <= tokens <= prompts + N * (OUT - 1)
    assert c["a2f_bytes"] == tokens * LAYERS * HIDDEN * FP32
    assert c["f2a_bytes"] == c["a2f_bytes"]
    assert c["a2f_bytes_per_token_layer"] == HIDDEN * FP32 == 512
    assert c["expected_a2f_bytes_per_token_layer"] == 512
    assert c["a2f_bytes_per_step"] == pytest.approx(c["a2f_bytes"] / steps)
    assert c["a2f_bytes_per_layer_step"] == pytest.approx(
        c["a2f_bytes"] / steps / LAYERS
    )
    assert c["batch_tokens_per_step"] == pytest.approx(tokens / steps)
    assert c["connector_wait_ms_per_step"] > 0 and c["ffn_compute_ms_per_step"] > 0
    assert c["errors"] == 0
    roles = {(r["role"], r["rank"]) for r in c["per_rank"]}
    assert roles == {("attention", 0), ("ffn", 0)}


def test_bench_metrics_on_both_roles_grow_across_requests(bench_run):
    poller = bench_run[2]
    for role, values in poller.seen.items():
        assert values == sorted(values), f"{role} afd_steps went down: {values}"
        # Warm-up requests, then the workload: at least two distinct counts.
        assert len({v for v in values if v > 0}) >= 2, (role, values)
