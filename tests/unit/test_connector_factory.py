"""Unit tests of the connector factory: names, aliases, options."""

from __future__ import annotations

import pytest

from vllm_afd.config import parse_afd_config
from vllm_afd.connector import (
    Fingerprint,
    canonical_name,
    create_connector,
    registered_names,
    validate_extra_config,
)
from vllm_afd.errors import AFDConfigError


def _fp(**kw) -> Fingerprint:
    base = dict(
        arch="X", hidden_size=8, dtype="float32", num_layers=2, moe_layers=(1,),
        num_experts=4, top_k=2, num_attention_ranks=2, num_ffn_ranks=1,
        compute_gate_on_attention=False, connector="p2p",
    )  # fmt: skip
    return Fingerprint(**{**base, **kw})


def test_registered_names_and_aliases():
    assert registered_names() == ("async", "loopback", "p2p")
    assert canonical_name("P2pNcclAFDConnector") == "p2p"
    assert canonical_name("loopback") == "loopback"


def test_unknown_connector_lists_registered_names():
    with pytest.raises(AFDConfigError) as e:
        canonical_name("foo")
    assert str(e.value).startswith(
        "afd.connector='foo' is not a registered connector; registered: async, "
        "loopback, p2p"
    )
    with pytest.raises(AFDConfigError, match="not a registered connector"):
        parse_afd_config({"role": "ffn", "connector": "foo"})


def test_extra_config_defaults_and_int_for_float():
    assert validate_extra_config("p2p", {}) == {
        "timeout_s": 60.0,
        "connect_timeout_s": 600.0,
        "warmup_timeout_s": 600.0,
        "backend": "auto",
        "allow_time_slicing": False,
        "ipc_copy": "ce",
        "heartbeat_interval_s": 1.0,
        "secret_file": "",
    }
    out = validate_extra_config("P2pNcclAFDConnector", {"timeout_s": 5})
    assert out["timeout_s"] == 5.0 and isinstance(out["timeout_s"], float)
    # A short timeout without a heartbeat interval gets a quarter of it.
    assert out["heartbeat_interval_s"] == 1.0
    assert validate_extra_config("p2p", {"timeout_s": 2})["heartbeat_interval_s"] == 0.5
    assert "backend" not in validate_extra_config("loopback", {})


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"timeout": 1}, r"connector_extra_config.timeout is not an option of "
         r"connector 'p2p'; valid keys: allow_time_slicing, backend, "
         r"connect_timeout_s, heartbeat_interval_s, ipc_copy, secret_file, timeout_s"),
        ({"timeout_s": 2, "heartbeat_interval_s": 2}, r"heartbeat_interval_s=2 must "
         r"be shorter than timeout_s=2"),
        ({"timeout_s": "5"}, r"timeout_s='5' has type str; it must be a number"),
        ({"timeout_s": True}, r"has type bool"),
        ({"timeout_s": 0}, r"must be > 0 seconds"),
        ({"backend": "mpi"}, r"backend='mpi' is not one of auto, gloo, nccl"),
        ({"secret_file": "/nonexistent/afd-secret"}, r"secret_file='/nonexistent/"
         r"afd-secret' cannot be read \(No such file or directory\)"),
        ({"secret_file": 7}, r"secret_file=7 has type int; it must be a string"),
    ],
)  # fmt: skip
def test_extra_config_errors_name_key_and_fix(extra, match):
    with pytest.raises(AFDConfigError, match=match):
        validate_extra_config("p2p", extra)


def test_parse_afd_config_resolves_alias_and_fills_options():
    cfg = parse_afd_config(
        {"role": "ffn", "connector": "P2pNcclAFDConnector", "num_attention_ranks": 2}
    )
    assert cfg.connector == "p2p"
    assert cfg.connector_extra_config["connect_timeout_s"] == 600.0


def test_create_connector_checks_rank_and_backend():
    cfg = parse_afd_config({"role": "attention", "num_attention_ranks": 2})
    conn = create_connector(cfg, 1, _fp())
    assert (conn.role.value, conn.role_rank, conn.topology.name) == (
        "attention", 1, "2A1F",
    )  # fmt: skip
    with pytest.raises(AFDConfigError, match="attention rank 2 outside 0..1"):
        create_connector(cfg, 2, _fp())
    nccl = parse_afd_config(
        {"role": "ffn", "connector_extra_config": {"backend": "nccl"}}
    )
    with pytest.raises(AFDConfigError, match="backend='nccl' moves cuda tensors"):
        create_connector(nccl, 0, _fp(num_attention_ranks=1))


def test_an_empty_secret_file_is_refused(tmp_path):
    empty = tmp_path / "secret"
    empty.write_text("\n")
    with pytest.raises(AFDConfigError, match=r"secret_file='.*secret' is empty"):
        validate_extra_config("p2p", {"secret_file": str(empty)})


def test_every_builder_is_a_module_function_string_that_loads():
    from vllm_afd.connector import factory

    for name in registered_names():
        s = factory.spec(name)
        module, sep, function = s.builder.partition(":")
        assert sep and module.startswith("vllm_afd.connector.") and function
        assert callable(s.load_builder())


def test_the_factory_imports_neither_the_config_nor_a_connector():
    """The registry sits below the config: no import circle, and parsing a
    config loads no connector (nor torch)."""
    import subprocess
    import sys

    script = (
        "import sys, vllm_afd.connector.factory\n"
        "mods = [m for m in sys.modules if m in ('vllm_afd.config', 'torch') "
        "or m.startswith(('vllm_afd.connector.p2p', 'vllm_afd.connector.loop'))]\n"
        "print(mods)"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
