"""``vllm-afd plan`` end to end on a tiny model: measure, predict, check.

One run profiles 1A1F AFD, plain vLLM and (shared cores) 2A1F AFD, predicts
every deployment of up to 3 role processes, and ``--check`` launches 1A1F
again and measures it beside its prediction. The report must hold every part with
sane values; a second run reads the cached profile and starts no server.
The prediction errors are printed in the summary (this machine is noisy:
they are figures, not assertions). A tensor-parallel colocated baseline
(``--tp-baselines``) is a plain server started with ``--tensor-parallel-size``
and profiled like the other (its report and cache: tests/unit/test_plan_model.py;
a plain TP 2 server is exact in test_scale_out.py); it is left out here, where a
TP 2 server on two cores is minutes of CI.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from harness import PLAN_RESULTS, free_ports, run_cli

from vllm_afd.deploy.cpu_mla import cpu_mla_args

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("quiet_host")]

ARGS = ["--enforce-eager", "--max-model-len", "512", "--dtype", "float32"]


def _plan(model, out, *extra: str) -> subprocess.CompletedProcess:
    port, ffn_port, afd_port = free_ports(3)
    argv = [
        "plan", str(model),
        *("--context-lens", "64", "--batch-sizes", "1,4"),
        *("--decode-tokens", "24", "--devices", "3"),
        *("--port", str(port), "--ffn-port", str(ffn_port)),
        *("--afd-port", str(afd_port), "--cache-dir", str(out / "cache")),
        *extra, "--", *ARGS, *cpu_mla_args(model),
    ]  # fmt: skip
    return run_cli(argv)


def test_plan_measures_predicts_and_checks(tiny_models, tmp_path):
    model = tiny_models["deepseek_v2"]
    report = tmp_path / "plan.json"
    run = _plan(model, tmp_path, "--check", "--check-topologies", "1A1F",
                "--json", str(report), "--plot", str(tmp_path / "plan.png"),
                "--server-log", str(tmp_path / "servers.log"))  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(report.read_text())
    prof = data["profile"]
    assert prof["platform"] == "cpu" and prof["remote_layers"] > 0
    for part in ("ffn", "comm"):
        assert [x for x, _ in prof[part]] == [1.0, 4.0]
    assert prof["ffn"][0][1] > 0  # the FFN computes something per step
    for context in ("64",):
        assert all(t > 0 for _, t in prof["attention"][context])
        assert all(t > 0 for _, t in prof["colocated"][context])
    assert prof["kv_tokens_attention"] > 0 and prof["kv_tokens_colocated"] > 0
    # S_2 measured on 2A1F: --devices 3 holds no third attention rank
    assert {k: set(v) for k, v in prof["sharing"].items()} == {"2": {"64"}}
    for p in data["points"]["afd"]:  # the counter windows hold decode steps
        assert p["ffn_tokens"] == pytest.approx(p["batch"], rel=0.25), p
    assert {k: len(v) for k, v in data["points"].items()} == {
        "afd": 2, "plain": 4, "shared2": 2,
    }  # fmt: skip
    # plain vLLM also where 2A1F holds its 2 x b sequences on this host
    assert [p["batch"] for p in data["points"]["plain"]] == [1, 2, 4, 8]
    assert len(data["plan"]["equal_batch"]) == len(data["plan"]["rows"])
    assert "plain vLLM holding as many sequences" in data["plan"]["reason"]
    baselines = {b["name"] for b in data["plan"]["baselines"].values()}
    assert baselines == {"colocated"}
    names = {r["name"] for r in data["plan"]["rows"]}
    assert names == {"1A1F", "2A1F"}  # 3 processes; no micro-batches on CPU
    rec = data["plan"]["recommended"]
    assert rec["name"] in names and data["plan"]["reason"]
    [check] = data["check"]
    assert check["deployment"] == "1A1F" and check["measured_step_ms"] > 0
    assert "recommended:" in run.stdout and "median |step error|" in run.stdout
    assert "measured on cpu" in run.stdout
    PLAN_RESULTS.append(
        f"1A1F batch {check['batch']}: predicted {check['predicted_step_ms']:.1f} "
        f"ms, measured {check['measured_step_ms']:.1f} ms "
        f"({check['step_error'] * 100:+.0f}%); recommended {rec['name']}; "
        f"baselines {sorted(baselines)}"
    )
    try:
        import matplotlib  # noqa: F401

        assert (tmp_path / "plan.png").stat().st_size > 0
    except ImportError:
        pass

    # the cached profile, and the scale model on 6 separate devices from it
    again = _plan(model, tmp_path, "--json", str(tmp_path / "again.json"),
                  "--target-devices", "6")  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert "using the cached profile" in again.stderr
    assert "starting" not in again.stderr  # no server
    cached = json.loads((tmp_path / "again.json").read_text())
    assert cached["plan"] == data["plan"]
    assert "predicted on 6 separate devices" in again.stdout
    scaled = {p["name"] for p in cached["target_devices"]["rows"]}
    assert {"5A1F", "3A3F", "1A1F"} <= scaled, scaled
