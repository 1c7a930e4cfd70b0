"""Where each rank runs across hosts, and the flags each node's launcher
derives (no servers)."""

from __future__ import annotations

import json
import shlex

import pytest

from vllm_afd.cli import main as cli
from vllm_afd.deploy import DeploymentSpec, dry_run, placement, role_processes
from vllm_afd.deploy.placement import Placement, PlacementError, node_rank_from

HOSTS = ("10.0.0.1", "10.0.0.2", "10.0.0.3")


def _spec(hosts: tuple[str, ...] = HOSTS, **kw) -> DeploymentSpec:
    return DeploymentSpec(model="m", cpu_workaround=False, hosts=hosts, **kw)


def _afd(proc) -> dict:
    return json.loads(proc.argv[proc.argv.index("--additional-config") + 1])["afd"]


def _flag(proc, name: str) -> str | None:
    return proc.argv[proc.argv.index(name) + 1] if name in proc.argv else None


@pytest.fixture(autouse=True)
def every_address_is_local(monkeypatch):
    """Each node's launcher checks its own address; here every one passes."""
    monkeypatch.setattr(placement, "interface_of", lambda address: "eth0")


def test_2a2f_over_three_hosts_node_by_node():
    spec = _spec(
        attention_ranks=2, ffn_ranks=2, attention_nodes=(0, 1), ffn_nodes=(2, 1)
    )
    by_node = {n: role_processes(spec, n) for n in range(3)}
    assert [p.name for p in by_node[0]] == ["attention"]
    assert [p.name for p in by_node[1]] == ["ffn1", "attention"]
    assert [p.name for p in by_node[2]] == ["ffn0"]
    leader, headless = by_node[0][0], by_node[1][1]
    assert not leader.headless and headless.headless
    for proc in (leader, headless):
        assert _flag(proc, "--data-parallel-size") == "2"
        assert _flag(proc, "--data-parallel-size-local") == "1"
        assert _flag(proc, "--data-parallel-address") == "10.0.0.1"
        assert _flag(proc, "--data-parallel-rpc-port") == str(spec.afd_port + 2)
    assert "--headless" in headless.argv and "--headless" not in leader.argv
    assert _flag(headless, "--data-parallel-start-rank") == "1"
    for n, procs in by_node.items():
        for proc in procs:
            assert _afd(proc)["host"] == "10.0.0.3"  # FFN rank 0's node
            assert proc.env["VLLM_HOST_IP"] == HOSTS[n]
            assert proc.env["GLOO_SOCKET_IFNAME"] == "eth0"
            assert _flag(proc, "--host") == HOSTS[n]  # the API on the node's address
    assert [_afd(p)["rank"] for p in (by_node[2][0], by_node[1][0])] == [0, 1]


def test_attention_on_one_node_keeps_single_host_data_parallelism():
    spec = _spec(HOSTS[:2], attention_ranks=2, ffn_ranks=1, attention_nodes=(0, 0))
    (att,) = role_processes(spec, 0)
    assert _flag(att, "--data-parallel-size") == "2"
    assert "--data-parallel-address" not in att.argv and not att.headless
    (ffn,) = role_processes(spec, 1)  # default: FFN ranks after node 0
    assert ffn.name == "ffn"


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"attention_nodes": (1, 0)}, "consecutive per node"),
        ({"attention_nodes": (0,)}, "lists 1 nodes for 2 ranks"),
        ({"ffn_nodes": (3,)}, "names node 3, but --hosts lists nodes 0..2"),
        ({"attention_nodes": (0, 0), "ffn_nodes": (1,)}, "node 2 .* runs no rank"),
    ],
)
def test_a_placement_that_cannot_run_is_refused(kw, match):
    with pytest.raises(PlacementError, match=match):
        _spec(attention_ranks=2, ffn_ranks=1, **kw).placement()


def test_hosts_with_an_empty_or_repeated_entry_are_refused():
    with pytest.raises(PlacementError, match="empty entry"):
        Placement.make(("10.0.0.1", ""), 1, 1)
    with pytest.raises(PlacementError, match="lists a host twice"):
        Placement.make(("10.0.0.1", "10.0.0.1"), 1, 1)


def test_node_rank_from_flag_then_lws_then_slurm():
    assert node_rank_from(2, {"LWS_WORKER_INDEX": "1"}, 3) == 2
    assert node_rank_from(None, {"LWS_WORKER_INDEX": "1"}, 3) == 1
    assert node_rank_from(None, {"SLURM_NODEID": "2"}, 3) == 2
    assert node_rank_from(None, {}, 1) == 0
    with pytest.raises(PlacementError, match="give this one's --node-rank"):
        node_rank_from(None, {}, 3)
    with pytest.raises(PlacementError, match="SLURM_NODEID=5, but --hosts"):
        node_rank_from(None, {"SLURM_NODEID": "5"}, 3)


def test_a_node_whose_address_is_not_local_is_refused(monkeypatch):
    monkeypatch.setattr(placement, "interface_of", lambda address: None)
    with pytest.raises(PlacementError, match="10.0.0.2 .* is not an address of this"):
        role_processes(_spec(HOSTS[:2], attention_ranks=1, ffn_ranks=1), 1)


def test_dry_run_prints_every_node_and_each_line_is_a_command():
    spec = _spec(
        attention_ranks=2, ffn_ranks=2, attention_nodes=(0, 1), ffn_nodes=(2, 1)
    )
    text = dry_run(spec)
    commands = [x for x in text.splitlines() if x and not x.startswith("#")]
    assert len(commands) == 4  # attention, ffn1 + headless attention, ffn0
    for line in commands:
        words = shlex.split(line)
        assert words[:3] == ["VLLM_HOST_IP=" + words[0].split("=")[1], *words[1:3]]
        assert "vllm-afd" in words and words[words.index("vllm-afd") + 1] == "serve"
    assert "# node 1 10.0.0.2: attention rank 1 (headless), ffn rank 1" in text


def test_launch_dry_run_from_the_command_line(capsys):
    code = cli.main(
        ["launch", "m", "-A", "2", "--hosts", ",".join(HOSTS),
         "--attention-nodes", "0,1", "--ffn-nodes", "2", "--dry-run"]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert out.count("vllm-afd serve m") == 3 and "--headless" in out


def test_launch_refuses_a_bad_placement_with_exit_2(capsys):
    code = cli.main(["launch", "m", "--hosts", "a,b", "--node-rank", "0",
                     "--attention-nodes", "0", "--ffn-nodes", "0"])  # fmt: skip
    assert code == 2
    assert "node 1 (b) runs no rank" in capsys.readouterr().err
