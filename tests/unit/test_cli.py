"""The launcher's process layout and the CLI's argument handling (no servers)."""

from __future__ import annotations

import json
import re

import pytest

from vllm_afd.cli import main as cli
from vllm_afd.config import parse_afd_config
from vllm_afd.deploy import DeploymentSpec, LaunchError, PlainServer, role_processes
from vllm_afd.deploy.commands import CPU_COMPILATION_CONFIG


def _afd(proc) -> dict:
    argv = proc.argv
    return json.loads(argv[argv.index("--additional-config") + 1])["afd"]


def test_role_processes_2a2f_one_server_per_ffn_rank_and_dp_attention() -> None:
    spec = DeploymentSpec(
        model="m",
        attention_ranks=2,
        ffn_ranks=2,
        port=9000,
        afd_port=30000,
        vllm_args=["--dtype", "float32"],
        ffn_args=["--tensor-parallel-size", "2"],
        cpu_workaround=False,
    )
    procs = role_processes(spec)
    assert [p.name for p in procs] == ["ffn0", "ffn1", "attention"]
    assert [p.port for p in procs] == [9001, 9002, 9000]
    for k, proc in enumerate(procs[:2]):
        afd = _afd(proc)
        assert afd["role"] == "ffn" and afd["rank"] == k
        assert "--data-parallel-size" not in proc.argv
        assert proc.argv[-4:-2] == ["--tensor-parallel-size", "2"]
        parse_afd_config(afd)  # every generated config is valid
    attention = procs[2]
    assert "rank" not in _afd(attention)
    dp = attention.argv.index("--data-parallel-size")
    assert attention.argv[dp + 1] == "2"
    assert "--tensor-parallel-size" not in attention.argv
    assert all(p.argv[-2:] == ["--dtype", "float32"] for p in procs)
    assert all(_afd(p)["port"] == 30000 for p in procs)


@pytest.mark.parametrize(
    ("a", "f", "cores", "ffn", "attention"),
    [
        (1, 1, [0, 1], ["0"], "1"),
        (2, 2, list(range(8)), ["0,1", "2,3"], "4,5|6,7"),
        (1, 2, [4, 5, 6, 7], ["4", "5"], "6"),  # one core left over
    ],
)
def test_cpu_bind_split_gives_each_role_process_cores_of_its_own(
    a: int, f: int, cores: list[int], ffn: list[str], attention: str, monkeypatch
) -> None:
    from vllm_afd.deploy.commands import BIND_ENV, split_cores

    monkeypatch.delenv(BIND_ENV, raising=False)
    spec = DeploymentSpec(
        model="m", attention_ranks=a, ffn_ranks=f, cpu_workaround=True
    )
    procs = role_processes(spec)  # vLLM's own binding: nothing set
    assert all(BIND_ENV not in p.env for p in procs)
    split_cores(spec, procs, a, cores)
    assert [p.env[BIND_ENV] for p in procs] == [*ffn, attention]


def test_cpu_servers_sleep_idle_openmp_threads_unless_the_user_chose(
    monkeypatch, capsys
) -> None:
    """Every CPU server the launcher starts (roles, plain vLLM, prefill
    servers) gets OMP_WAIT_POLICY=PASSIVE, shown by --dry-run; a policy in
    the environment is kept; CUDA servers get none."""
    import torch

    from vllm_afd.deploy.commands import OMP_WAIT_ENV, memory_budget
    from vllm_afd.deploy.pd import PDSpec, pd_processes

    monkeypatch.delenv(OMP_WAIT_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # CPU host
    cpu = DeploymentSpec(model="m", attention_ranks=2, ffn_ranks=2, cpu_workaround=True)
    servers = [*role_processes(cpu), PlainServer(cpu).process]
    prefills, _router = pd_processes(
        PDSpec.make(cpu, prefill=2, port=9000), {"kv_connector": "x"},
        memory_budget(cpu),
    )  # fmt: skip
    servers += prefills
    assert [p.env.get(OMP_WAIT_ENV) for p in servers] == ["PASSIVE"] * 6
    assert cli.main(["launch", "m", "--dry-run", "--", "--dtype", "float32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(x.startswith("OMP_WAIT_POLICY=PASSIVE ") for x in lines) == 2, lines
    gpu = DeploymentSpec(model="m", cpu_workaround=False)
    assert all(OMP_WAIT_ENV not in p.env for p in role_processes(gpu))
    monkeypatch.setenv(OMP_WAIT_ENV, "ACTIVE")
    assert {p.env[OMP_WAIT_ENV] for p in role_processes(cpu)} == {"ACTIVE"}


def test_cpu_bind_split_refuses_what_it_cannot_place(monkeypatch) -> None:
    from vllm_afd.deploy.commands import BIND_ENV, split_cores

    monkeypatch.delenv(BIND_ENV, raising=False)
    spec = DeploymentSpec(model="m", ffn_ranks=2, cpu_workaround=True)
    with pytest.raises(LaunchError, match=r"1 attention rank\(s\) and 2 FFN rank"):
        split_cores(spec, role_processes(spec), 1, [0, 1])
    monkeypatch.setenv(BIND_ENV, "0-3")
    with pytest.raises(LaunchError, match="is set, and --cpu-bind split sets it"):
        split_cores(spec, role_processes(spec), 1, [0, 1, 2, 3])
    spec = DeploymentSpec(model="m", cpu_workaround=False, cpu_bind="split")
    with pytest.raises(LaunchError, match="this deployment runs on CUDA"):
        role_processes(spec)


def test_role_processes_1a1f_adds_cpu_workaround_unless_user_sets_compilation() -> None:
    spec = DeploymentSpec(model="m", cpu_workaround=True)
    procs = role_processes(spec)
    assert [p.name for p in procs] == ["ffn", "attention"]
    for proc in procs:
        assert proc.argv[-1] == CPU_COMPILATION_CONFIG
        assert "rank" not in _afd(proc)
    spec.vllm_args = ["--compilation-config", "{}"]
    assert all(CPU_COMPILATION_CONFIG not in p.argv for p in role_processes(spec))


def test_role_processes_do_not_leak_server_pid_to_children(monkeypatch) -> None:
    monkeypatch.setenv("AFD_SERVER_PID", "1")
    for proc in role_processes(DeploymentSpec(model="m", cpu_workaround=False)):
        assert "AFD_SERVER_PID" not in proc.env


def test_main_launch_options_after_model_and_vllm_args_after_double_dash(
    monkeypatch,
) -> None:
    seen = {}

    def fake_launch(args) -> int:
        seen["a"] = args
        return 0

    monkeypatch.setattr(cli, "build_parser", _parser_with(fake_launch))
    assert (
        cli.main(
            [
                "launch",
                "MODEL",
                "--port",
                "8100",
                "-A",
                "2",
                "--",
                "--port",
                "1",
                "-tp",
                "2",
            ]
        )
        == 0
    )
    args = seen["a"]
    assert (args.model, args.port, args.attention_ranks) == ("MODEL", 8100, 2)
    assert args.vllm_args == ["--port", "1", "-tp", "2"]


def _parser_with(func):
    original = cli.build_parser

    def build():
        parser = original()
        for action in parser._subparsers._group_actions:
            action.choices["launch"].set_defaults(func=func)
        return parser

    return build


def test_main_rejects_vllm_args_for_commands_without_them() -> None:
    with pytest.raises(SystemExit):
        cli.main(["tiny-model", "out", "--", "--dtype", "float32"])


def test_tiny_model_refuses_a_bad_expert_count_in_one_line(tmp_path, capsys) -> None:
    out = tmp_path / "m"
    assert (
        cli.main(["tiny-model", str(out), "--arch", "qwen3_moe", "--experts", "12"])
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith(
        "vllm-afd tiny-model: num_experts=12 must be a positive multiple of "
        "qwen3_moe's 8"
    )
    assert "Traceback" not in err and not out.exists()


def test_deployment_spec_from_launch_and_bench_command_lines() -> None:
    parser = cli.build_parser()
    launch = parser.parse_args(
        ["launch", "M", "-A", "4", "-F", "2", "--host", "10.0.0.5",
         "--gate-on-attention", "--ffn-args", "-tp 2",
         "--connector-extra-config", '{"timeout_s": 5}']
    )  # fmt: skip
    spec = DeploymentSpec.from_args(launch, ["--dtype", "float32"])
    assert (spec.model, spec.attention_ranks, spec.ffn_ranks) == ("M", 4, 2)
    assert spec.host == "10.0.0.5" and spec.gate_on_attention
    assert spec.ffn_args == ["-tp", "2"] and spec.attention_args == []
    assert spec.connector_extra_config == {"timeout_s": 5}
    assert spec.vllm_args == ["--dtype", "float32"]

    bench = parser.parse_args(["bench", "--model", "M", "-A", "2"])
    spec = DeploymentSpec.from_args(bench, [])
    assert (spec.model, spec.attention_ranks, spec.ffn_ranks) == ("M", 2, 1)
    assert spec.host == DeploymentSpec.host and spec.ffn_args == []


def test_ubatches_reach_the_attention_role_only() -> None:
    spec = DeploymentSpec(model="m", ubatches=2, cpu_workaround=False)
    ffn, attention = role_processes(spec)
    assert _afd(attention)["num_ubatches"] == 2
    assert "num_ubatches" not in _afd(ffn)
    assert parse_afd_config(_afd(attention)).num_ubatches == 2
    assert "num_ubatches" not in _afd(role_processes(DeploymentSpec(model="m"))[1])


def test_devices_per_role_and_the_baseline_gets_them_all(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    parser = cli.build_parser()
    args = parser.parse_args(
        ["launch", "M", "-F", "2", "--attention-devices", "0,1", "--ffn-devices", "2,3"]
    )
    spec = DeploymentSpec.from_args(args, [])
    spec.cpu_workaround = False
    ffn0, ffn1, attention = role_processes(spec)
    assert attention.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert (ffn0.env["CUDA_VISIBLE_DEVICES"], ffn1.env["CUDA_VISIBLE_DEVICES"]) == (
        "2",
        "3",
    )
    assert PlainServer(spec, log=None).process.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    bench = parser.parse_args(["bench", "--model", "M", "--ffn-devices", "1"])
    assert DeploymentSpec.from_args(bench, []).ffn_devices == "1"
    # not given: the environment's devices, for every process
    plain = DeploymentSpec(model="m", cpu_workaround=False)
    assert all(p.env["CUDA_VISIBLE_DEVICES"] == "7" for p in role_processes(plain))
    assert PlainServer(plain, log=None).process.env["CUDA_VISIBLE_DEVICES"] == "7"


@pytest.mark.parametrize(
    ("attention", "ffn", "ranks", "message"),
    [
        ("0", "1,2,3", 2, "lists 3 devices for 2 FFN ranks"),
        ("0,1", "1", 1, "GPU 1 is in both --attention-devices and --ffn-devices"),
        ("0,", "1", 1, "--attention-devices='0,' has an empty entry"),
    ],
)
def test_bad_device_lists_are_refused_before_anything_starts(
    attention: str, ffn: str, ranks: int, message: str
) -> None:
    spec = DeploymentSpec(
        model="m", ffn_ranks=ranks, attention_devices=attention, ffn_devices=ffn,
        connector_extra_config={"backend": "nccl"},
    )  # fmt: skip
    with pytest.raises(LaunchError, match=re.escape(message)):
        role_processes(spec)


def test_launch_reports_a_bad_device_list_and_exits_2(capsys) -> None:
    code = cli.main(
        ["launch", "M", "--attention-devices", "0", "--ffn-devices", "0",
         "--connector-extra-config", '{"backend": "nccl"}']
    )  # fmt: skip
    assert code == 2
    assert "GPU 0 is in both" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [{}, {"backend": "auto"}, {"backend": "cuda_ipc"}])
def test_roles_sharing_a_gpu_get_the_cuda_ipc_plane(extra: dict) -> None:
    spec = DeploymentSpec(
        model="m", attention_devices="0", ffn_devices="0",
        connector_extra_config=extra,
    )  # fmt: skip
    assert spec.data_plane() == "cuda_ipc"
    attention, ffn = role_processes(spec)
    assert attention.env["CUDA_VISIBLE_DEVICES"] == ffn.env["CUDA_VISIBLE_DEVICES"]
    for role in ("attention", "ffn"):
        assert spec.afd_config(role)["connector_extra_config"]["backend"] == "cuda_ipc"


@pytest.mark.parametrize(
    ("attention", "ffn", "ffn_ranks", "plain"),
    [
        ("0", "0", 1, "0"),
        ("0", "1", 1, "0,1"),
        ("0,1", "2,3", 2, "0,1,2,3"),
        ("0", "0,1", 2, "0,1"),
        (None, None, 1, None),
    ],
)
def test_the_plain_baseline_sees_every_gpu_of_the_roles_once(
    attention: str | None, ffn: str | None, ffn_ranks: int, plain: str | None
) -> None:
    # "0,0" (both roles on GPU 0) would hide every GPU from CUDA
    spec = DeploymentSpec(
        model="m", ffn_ranks=ffn_ranks, attention_devices=attention, ffn_devices=ffn
    )
    assert spec.plain_devices() == plain


def test_roles_on_their_own_gpus_keep_auto_which_is_nccl() -> None:
    spec = DeploymentSpec(model="m", attention_devices="0", ffn_devices="1")
    assert spec.data_plane() == "nccl"
    assert "backend" not in spec.afd_config("ffn")["connector_extra_config"]


@pytest.mark.parametrize(
    ("ranks", "devices", "args", "per_device"),
    [
        (2, "0", [], 2),
        (4, "0,1", [], 2),
        (2, "0,1", [], 1),
        (2, "0,1,2", [], 1),
        (2, "0,1", ["--tensor-parallel-size", "2"], 2),
        (2, "0,1", ["-tp=2"], 2),
        (2, None, [], 1),
    ],
)
def test_fewer_attention_gpus_than_ranks_share_them(
    ranks: int, devices: str | None, args: list[str], per_device: int
) -> None:
    spec = DeploymentSpec(
        model="m",
        attention_ranks=ranks,
        attention_devices=devices,
        ffn_devices="7",
        attention_args=args,
        cpu_workaround=False,
    )
    assert spec.attention_ranks_per_device() == per_device
    ffn, attention = role_processes(spec)
    assert parse_afd_config(_afd(attention)).attention_ranks_per_device == per_device
    assert "attention_ranks_per_device" not in _afd(ffn)


def test_shared_attention_gpus_get_a_memory_share_unless_one_is_given() -> None:
    spec = DeploymentSpec(
        model="m", attention_ranks=2, attention_devices="0", cpu_workaround=False
    )
    attention = role_processes(spec)[-1]
    i = attention.argv.index("--gpu-memory-utilization")
    assert attention.argv[i + 1] == "0.45"
    spec.attention_args = ["--gpu-memory-utilization=0.3"]
    assert role_processes(spec)[-1].argv.count("--gpu-memory-utilization") == 0
    alone = DeploymentSpec(model="m", attention_ranks=2, attention_devices="0,1")
    assert "--gpu-memory-utilization" not in role_processes(alone)[-1].argv


def test_attention_gpus_that_do_not_split_over_the_ranks_are_refused() -> None:
    spec = DeploymentSpec(model="m", attention_ranks=3, attention_devices="0,1")
    with pytest.raises(LaunchError, match="lists 2 GPUs for 3 attention ranks"):
        role_processes(spec)


@pytest.mark.parametrize(
    ("flags", "role_args", "bound", "url"),
    [
        ([], [], "127.0.0.1", "http://127.0.0.1:9000"),
        (["--api-host", "0.0.0.0"], [], "0.0.0.0", "http://127.0.0.1:9000"),
        (["--api-host", "::1"], [], "::1", "http://[::1]:9000"),
        ([], ["--host", "10.1.2.3"], "10.1.2.3", "http://10.1.2.3:9000"),
    ],
)
def test_every_role_binds_the_api_host_and_its_url_says_where(
    flags, role_args, bound, url
) -> None:
    """``--api-host`` reaches every role's ``vllm serve --host``; a ``--host``
    among the vLLM arguments comes later on the command line and wins."""
    args = cli.build_parser().parse_args(["launch", "M", "--port", "9000", *flags])
    spec = DeploymentSpec.from_args(args, role_args)
    spec.cpu_workaround = False
    for proc in role_processes(spec):
        hosts = [proc.argv[i + 1] for i, a in enumerate(proc.argv) if a == "--host"]
        assert hosts[-1] == bound and proc.host == bound
    attention = role_processes(spec)[-1]
    assert attention.url == url


@pytest.mark.parametrize(
    ("api_host", "line"),
    [
        ("127.0.0.1", "AFD 2A1F ready: http://127.0.0.1:9000/v1"),
        (
            "0.0.0.0",
            "AFD 2A1F ready: http://127.0.0.1:9000/v1 (the API listens on all "
            "interfaces, 0.0.0.0)",
        ),
    ],
)
def test_ready_line_is_the_url_a_local_client_uses(api_host, line) -> None:
    from vllm_afd.deploy import Deployment, ready_line

    spec = DeploymentSpec(
        model="m", attention_ranks=2, port=9000, api_host=api_host, cpu_workaround=False
    )
    assert ready_line(Deployment(spec, log=None)) == line


def test_launch_help_shows_every_default_and_documents_every_flag(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["launch", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, default in [
        ("--attention-ranks", "1"), ("--ffn-ranks", "1"), ("--port", "8000"),
        ("--api-host", "127.0.0.1"), ("--host", "127.0.0.1"),
        ("--afd-port", "29650"), ("--connector", "p2p"), ("--ubatches", "1"),
        ("--ready-timeout", "600.0"),
    ]:  # fmt: skip
        assert re.search(rf"{flag} \S+ .*?\(default: {re.escape(default)}\)", text), (
            flag
        )
    parser = cli.build_parser()
    launch = next(
        a
        for a in parser._subparsers._group_actions[0].choices.items()
        if a[0] == "launch"
    )[1]
    undocumented = [a.dest for a in launch._actions if not a.help]
    assert undocumented == [], undocumented


def test_role_processes_carry_the_launcher_pid(monkeypatch) -> None:
    import os

    for proc in role_processes(DeploymentSpec(model="m", cpu_workaround=False)):
        assert proc.env["AFD_LAUNCHER_PID"] == str(os.getpid())


def test_the_demo_serves_each_family_in_a_dtype_plain_vllm_serves_on_cpu() -> None:
    from vllm_afd.cli.demo import demo_vllm_args

    def dtype(arch: str) -> str:
        args = demo_vllm_args(arch)
        return args[args.index("--dtype") + 1]

    assert dtype("deepseek_v2") == "float32"
    assert dtype("qwen3_next") == "bfloat16"  # CPU GDN attention requires BF16
