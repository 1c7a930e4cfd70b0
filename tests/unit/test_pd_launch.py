"""``launch --prefill``: the processes of a PD deployment, where the KV
connector goes, and what is refused (no servers)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from vllm_afd.cli import main as cli
from vllm_afd.deploy import DeploymentSpec, LaunchError, role_processes
from vllm_afd.deploy.commands import memory_budget
from vllm_afd.deploy.memory import GPU_UTILIZATION, MAX_AUTO_KV_BYTES
from vllm_afd.deploy.pd import (
    DEFAULT_KV_CONNECTOR,
    PREFILL_AFD_PORT_OFFSET,
    AFDPrefill,
    PDDeployment,
    PDSpec,
    default_kv_config,
    kv_transfer_config,
    parse_prefill,
    pd_budget,
    pd_dry_run,
    pd_processes,
    prefill_deployment_spec,
    side_config,
)
from vllm_afd.deploy.spec import KV_TRANSFER_FLAG, vllm_arg, without_option

KV = {"kv_connector": "ExampleConnector", "kv_connector_extra_config": {"x": 1}}


def _spec(**kw) -> DeploymentSpec:
    base = dict(model="m", port=9000, afd_port=30000, cpu_workaround=False)
    return DeploymentSpec(**{**base, **kw})


def _kv_of(argv: list[str]) -> dict | None:
    raw = vllm_arg(argv, KV_TRANSFER_FLAG)
    return None if raw is None else json.loads(raw)


def test_kv_transfer_config_is_read_in_both_forms_and_bad_ones_refused() -> None:
    assert kv_transfer_config(["--dtype", "float32"]) is None
    assert kv_transfer_config([KV_TRANSFER_FLAG, json.dumps(KV)]) == KV
    assert kv_transfer_config([f"{KV_TRANSFER_FLAG}={json.dumps(KV)}"]) == KV
    with pytest.raises(LaunchError, match="is not JSON"):
        kv_transfer_config([KV_TRANSFER_FLAG, "{kv_connector"])
    with pytest.raises(LaunchError, match="with a kv_connector"):
        kv_transfer_config([KV_TRANSFER_FLAG, '{"kv_role": "kv_both"}'])
    args = ["--a", "1", KV_TRANSFER_FLAG, "{}", f"{KV_TRANSFER_FLAG}=x", "--b"]
    assert without_option(args, KV_TRANSFER_FLAG) == ["--a", "1", "--b"]


def test_each_side_gets_its_kv_role_unless_the_user_gave_one() -> None:
    assert json.loads(side_config(KV, "kv_producer"))["kv_role"] == "kv_producer"
    mine = {**KV, "kv_role": "kv_both"}
    assert json.loads(side_config(mine, "kv_consumer"))["kv_role"] == "kv_both"


def test_without_prefill_a_kv_connector_reaches_the_attention_role_only() -> None:
    spec = _spec(vllm_args=["--dtype", "float32", KV_TRANSFER_FLAG, json.dumps(KV)])
    ffn, attention = role_processes(spec)
    assert _kv_of(attention.argv) == KV
    assert _kv_of(ffn.argv) is None
    assert ffn.argv[-2:] == ["--dtype", "float32"]
    with pytest.raises(LaunchError, match="FFN role holds no KV cache"):
        role_processes(_spec(ffn_args=[KV_TRANSFER_FLAG, json.dumps(KV)]))


def test_pd_ports_follow_the_router_and_the_kv_config_leaves_the_common_args() -> None:
    decode = _spec(attention_ranks=2, ffn_ranks=2, vllm_args=[KV_TRANSFER_FLAG, "{}"])
    with pytest.raises(LaunchError, match="with a kv_connector"):
        PDSpec.make(decode, prefill=1, port=9000)
    decode.vllm_args = ["--dtype", "float32", KV_TRANSFER_FLAG, json.dumps(KV)]
    pd = PDSpec.make(decode, prefill=2, port=9000)
    assert pd.kv_config == KV
    assert pd.decode.port == 9001 and pd.first_prefill_port() == 9004
    assert KV_TRANSFER_FLAG not in pd.decode.vllm_args
    ports = [p.port for p in role_processes(pd.decode)]
    assert ports == [9002, 9003, 9001]
    prefills, router = pd_processes(pd, KV, pd_budget(pd))
    assert [(p.name, p.port) for p in prefills] == [
        ("prefill0", 9004),
        ("prefill1", 9005),
    ]
    assert all(_kv_of(p.argv)["kv_role"] == "kv_producer" for p in prefills)
    assert prefills[0].argv[-2:] == ["--dtype", "float32"]
    argv = router.argv
    assert argv[1:3] == ["-m", "vllm_router.launch_router"]
    assert "--vllm-pd-disaggregation" in argv
    assert argv[argv.index("--port") + 1] == "9000"
    assert argv[argv.index("--decode") + 1] == "http://127.0.0.1:9001"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--prefill"] == [
        "http://127.0.0.1:9004",
        "http://127.0.0.1:9005",
    ]
    given = PDSpec.make(
        _spec(), prefill=1, port=7000, decode_port=7100, prefill_port=7200
    )
    assert (given.decode.port, given.first_prefill_port()) == (7100, 7200)


@pytest.mark.parametrize(
    ("kw", "pd_kw", "match"),
    [
        ({}, {"prefill": 0}, "at least 1 prefill server"),
        ({"hosts": ("10.0.0.1", "10.0.0.2")}, {}, "across hosts start them yourself"),
        ({"ffn_args": [KV_TRANSFER_FLAG, "{}"]}, {}, "FFN role holds no KV cache"),
    ],
)
def test_pd_refusals(kw, pd_kw, match) -> None:
    with pytest.raises(LaunchError, match=match):
        PDSpec.make(_spec(**kw), **{"prefill": 1, "port": 9000, **pd_kw})


def test_on_cpu_prefill_servers_share_the_kv_budget_of_the_host(monkeypatch) -> None:
    import vllm_afd.deploy.commands as commands

    monkeypatch.setattr(commands, "available_ram", lambda: 24 << 30)
    monkeypatch.setattr(commands, "checkpoint_bytes", lambda model: 0)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    pd = PDSpec.make(_spec(cpu_workaround=True), prefill=1, port=9000)
    budget = pd_budget(pd)
    size = budget.attention_args[1]
    prefills, _ = pd_processes(pd, KV, budget)
    assert vllm_arg(prefills[0].argv, "--kv-cache-memory-bytes") == size
    # two KV holders of three workers: (24 - 3 * 3) * 0.8 / 2 GiB, at most 1
    assert int(size) == MAX_AUTO_KV_BYTES
    mine = PDSpec.make(
        _spec(cpu_workaround=True), prefill=1, port=9000,
        prefill_args=["--kv-cache-memory-bytes", "1G"],
    )  # fmt: skip
    prefills, _ = pd_processes(mine, KV, pd_budget(mine))
    assert vllm_arg(prefills[0].argv, "--kv-cache-memory-bytes") == "1G"


def test_dry_run_lists_every_process_in_start_order(tmp_path, capsys) -> None:
    text = pd_dry_run(PDSpec.make(_spec(), prefill=1, port=9000), tmp_path / "kv")
    heads = [line for line in text.splitlines() if line.startswith("# ")]
    kinds = ("prefill", "ffn", "attention", "router")
    names = [h[2:] for h in heads if h[2:] in kinds]
    assert names == ["prefill", "ffn", "attention", "router"]
    assert (
        json.dumps(default_kv_config(tmp_path / "kv"))[:-1]
        .split('"kv_connector": ')[1]
        .startswith(f'"{DEFAULT_KV_CONNECTOR}"')
    )
    assert str(tmp_path / "kv") in text
    code = cli.main(
        ["launch", "m", "--prefill", "1", "--dry-run", "--", "--dtype", "float32"]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "vllm-router --vllm-pd-disaggregation" in out
    assert '"kv_role": "kv_consumer"' in out and '"kv_role": "kv_producer"' in out


def test_launch_without_the_router_says_how_to_install_it(monkeypatch, capsys) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "vllm_router" else real(name, *a),
    )
    assert cli.main(["launch", "m", "--prefill", "1", "--", "--dtype", "float32"]) == 2
    assert "pip install 'vllm-afd[pd]'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("2", 2),
        ("1A1F", AFDPrefill(1, 1)),
        ("2a1f", AFDPrefill(2, 1)),
        ("1A2F:async", AFDPrefill(1, 2, "async")),
    ],
)
def test_prefill_is_a_count_or_an_afd_topology(text, parsed) -> None:
    assert parse_prefill(text) == parsed


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("1A2F", "must be >= afd.num_ffn_ranks"),  # p2p: A >= F
        ("0A1F:async", "at least one rank per role"),
        ("1A1F:sync", "got '1A1F:sync'"),
        ("AF", "got 'AF'"),
        ("two", "got 'two'"),
    ],
)
def test_bad_prefill_values_are_refused_saying_what_is_taken(text, match) -> None:
    with pytest.raises(LaunchError, match=match):
        parse_prefill(text)


def test_an_afd_prefill_deployment_is_its_own_deployment_and_the_kv_producer(
    tmp_path,
) -> None:
    decode = _spec(vllm_args=["--dtype", "float32", KV_TRANSFER_FLAG, json.dumps(KV)])
    pd = PDSpec.make(decode, prefill=parse_prefill("1A2F:async"), port=9000)
    assert pd.prefill_ports() == 3 and pd.first_prefill_port() == 9003
    assert pd.metrics_port() == 9006
    prefill = prefill_deployment_spec(pd, KV)
    assert (prefill.attention_ranks, prefill.ffn_ranks) == (1, 2)
    assert prefill.connector == "async" and prefill.gate_on_attention
    assert (prefill.port, prefill.ffn_port) == (9003, 9004)
    assert prefill.afd_port == decode.afd_port + PREFILL_AFD_PORT_OFFSET
    ffn0, ffn1, attention = role_processes(prefill)
    assert (ffn0.port, ffn1.port, attention.port) == (9004, 9005, 9003)
    assert _kv_of(attention.argv)["kv_role"] == "kv_producer"
    assert _kv_of(ffn0.argv) is None and _kv_of(ffn1.argv) is None
    # no plain prefill servers; the router sends prefill to its attention API
    prefills, router = pd_processes(pd, KV, pd_budget(pd))
    assert prefills == []
    argv = router.argv
    assert argv[argv.index("--prefill") + 1] == "http://127.0.0.1:9003"
    assert argv[argv.index("--prometheus-port") + 1] == "9006"
    # its roles are shown apart from the decode deployment's
    running = PDDeployment(pd, log=None, log_dir=tmp_path)
    assert [p.label for p in running.processes] == [
        "prefill-ffn0", "prefill-ffn1", "prefill-attention",
        "ffn", "attention", "router",
    ]  # fmt: skip
    assert running.prefill_urls == ["http://127.0.0.1:9003"]
    text = pd_dry_run(pd, tmp_path / "kv")
    heads = [line[2:] for line in text.splitlines() if line.startswith("# ")]
    assert (
        heads[0]
        == "PD: an AFD 1A2F:async prefill deployment, AFD decode, router on 9000"
    )
    roles = ("prefill-ffn0", "prefill-ffn1", "prefill-attention", "ffn", "attention")
    assert [h for h in heads if h in roles] == list(roles)


def test_on_cpu_an_afd_prefill_deployment_takes_kv_and_ffn_shares(monkeypatch) -> None:
    import vllm_afd.deploy.commands as commands

    monkeypatch.setattr(commands, "available_ram", lambda: 13 << 30)
    monkeypatch.setattr(commands, "checkpoint_bytes", lambda model: 0)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    plain = pd_budget(PDSpec.make(_spec(cpu_workaround=True), prefill=1, port=9000))
    afd = PDSpec.make(_spec(cpu_workaround=True), prefill=AFDPrefill(1, 1), port=9000)
    budget = pd_budget(afd)
    # one more worker (the prefill FFN rank) on the host: less per KV holder,
    # (13 - 3 * 3) * 0.8 / 2 GiB (capped at 1) against (13 - 4 * 3) * 0.8 / 2
    gib = 1 << 30
    assert int(plain.attention_args[1]) == MAX_AUTO_KV_BYTES
    assert abs(int(budget.attention_args[1]) - 0.4 * gib) < 1 << 20  # MiB rounding
    attention = role_processes(prefill_deployment_spec(afd, KV), budget=budget)[-1]
    size = vllm_arg(attention.argv, "--kv-cache-memory-bytes")
    assert size == budget.attention_args[1]


def test_on_one_gpu_the_prefill_side_takes_a_share_of_it(monkeypatch) -> None:
    """Beside decode roles sharing a GPU, a prefill server given no devices
    (it sees the GPU first) is sized like an attention rank, where vLLM's
    default of 0.9 of the GPU would not fit; on a GPU of its own it is not."""
    import vllm_afd.deploy.commands as commands
    import vllm_afd.deploy.pd as pd

    monkeypatch.setattr(commands, "checkpoint_bytes", lambda model: 1 << 30)
    monkeypatch.setattr(commands, "gpu_total_bytes", lambda device: 100 << 30)
    monkeypatch.setattr(pd, "visible_gpus", lambda: ["0"])
    one_gpu = _spec(attention_devices="0", ffn_devices="0")
    alone = memory_budget(one_gpu)
    spec = PDSpec.make(one_gpu, prefill=1, port=9000)
    budget = pd_budget(spec)
    ffn_share = float(alone.ffn_args[1])
    assert budget.ffn_args == alone.ffn_args
    # two attention-sized holders of what the FFN rank leaves
    assert float(alone.attention_args[1]) == pytest.approx(GPU_UTILIZATION - ffn_share)
    assert float(budget.attention_args[1]) == pytest.approx(
        (GPU_UTILIZATION - ffn_share) / 2, abs=0.011
    )
    prefills, _ = pd_processes(spec, KV, budget)
    share = vllm_arg(prefills[0].argv, "--gpu-memory-utilization")
    assert share == budget.attention_args[1]
    # an AFD prefill deployment: its attention and FFN ranks take shares too
    afd = PDSpec.make(one_gpu, prefill=AFDPrefill(1, 1), port=9000)
    shares = pd_budget(afd)
    assert float(shares.attention_args[1]) == pytest.approx(
        (GPU_UTILIZATION - 2 * ffn_share) / 2, abs=0.011
    )
    # the prefill server on another GPU: the decode roles keep theirs
    apart = PDSpec.make(one_gpu, prefill=1, port=9000, prefill_devices="1")
    assert pd_budget(apart) == alone
    prefills, _ = pd_processes(apart, KV, pd_budget(apart))
    assert vllm_arg(prefills[0].argv, "--gpu-memory-utilization") is None


@pytest.mark.parametrize("prefill_devices", [None, "1"])
def test_on_a_shared_gpu_the_prefill_side_is_healthy_before_decode_starts(
    monkeypatch, tmp_path, prefill_devices
) -> None:
    """vLLM sizes its KV cache from what the GPU frees while it starts: on
    a GPU both sides share, the decode side starts once prefill is healthy;
    on GPUs of their own both start together."""
    import vllm_afd.deploy.commands as commands
    import vllm_afd.deploy.pd as pd

    monkeypatch.setattr(commands, "checkpoint_bytes", lambda model: 1 << 30)
    monkeypatch.setattr(commands, "gpu_total_bytes", lambda device: 100 << 30)
    monkeypatch.setattr(pd, "visible_gpus", lambda: ["0"])
    spec = PDSpec.make(
        _spec(attention_devices="0", ffn_devices="0"),
        prefill=1,
        port=9000,
        prefill_devices=prefill_devices,
    )
    running = PDDeployment(spec, log=None, log_dir=tmp_path)
    events: list[str] = []
    prefill, router = running.prefills[0], running.router
    monkeypatch.setattr(prefill, "start", lambda log: events.append("prefill"))
    monkeypatch.setattr(router, "start", lambda log: events.append("router"))
    monkeypatch.setattr(running.decode, "start", lambda t: events.append("decode"))

    def wait(procs, deadline, timeout):
        events.append("healthy: " + ",".join(p.name for p in procs))

    monkeypatch.setattr(running, "_wait", wait)
    running.start(ready_timeout=5)
    if prefill_devices is None:
        assert events[:3] == ["prefill", "healthy: prefill", "decode"]
    else:
        assert events[:2] == ["prefill", "decode"]
    assert events[-2:] == ["router", "healthy: router"]


def test_launch_dry_run_with_an_afd_prefill_deployment(capsys) -> None:
    argv = ["launch", "m", "--prefill", "2A1F", "--dry-run", "--", "--dtype", "float32"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "# prefill-attention" in out and "# prefill-ffn" in out
    assert '"kv_role": "kv_producer"' in out and '"kv_role": "kv_consumer"' in out
    with pytest.raises(SystemExit):
        cli.main(["launch", "m", "--prefill", "1A3F", "--dry-run"])
    assert "must be >= afd.num_ffn_ranks" in capsys.readouterr().err


def test_plain_decode_puts_one_plain_server_where_the_afd_deployment_was(
    tmp_path,
) -> None:
    spec = PDSpec.make(_spec(), prefill=1, port=9000, plain_decode=True)
    assert spec.decode_name == "plain decode"
    text = pd_dry_run(spec, tmp_path / "kv")
    heads = [line[2:] for line in text.splitlines() if line.startswith("# ")]
    assert heads[1:] == [
        "prefill",
        "decode (plain vLLM, the KV consumer)",
        "router",
    ], heads
    lines = text.splitlines()
    decode = lines[lines.index("# decode (plain vLLM, the KV consumer)") + 1]
    assert "--port 9001" in decode and '"kv_role": "kv_consumer"' in decode
    assert "afd" not in decode.split("serve", 1)[1]  # no AFD config
    pd = PDDeployment(spec, log=None, log_dir=tmp_path)
    assert [p.name for p in pd.processes] == ["prefill", "decode", "router"]
    assert pd.decode.ffns == [] and pd.decode.api_url == "http://127.0.0.1:9001"
    assert "--decode http://127.0.0.1:9001" in " ".join(pd.router.argv)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--plain-decode"], "give --prefill"),
        (["--prefill", "1", "--plain-decode", "-A", "2"], "leave them out"),
        (["--prefill", "1", "--plain-decode", "-F", "2"], "leave them out"),
    ],
)
def test_plain_decode_refusals(argv, match, capsys) -> None:
    assert cli.main(["launch", "m", *argv, "--dry-run"]) == 2
    assert match in capsys.readouterr().err
