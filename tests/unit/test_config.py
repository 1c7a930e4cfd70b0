"""Unit tests for parsing ``additional_config["afd"]`` (vllm_afd.config)."""

from __future__ import annotations

import dataclasses
import json
import re
from types import MappingProxyType
from typing import Any

import pytest

from vllm_afd.config import (
    AFD_KEY,
    DEFAULT_PORT,
    AFDConfig,
    AFDRole,
    afd_config_from_additional,
    parse_afd_config,
)
from vllm_afd.connector.factory import registered_names
from vllm_afd.errors import AFDConfigError, AFDError


def _raises(raw: Any, pattern: str) -> AFDConfigError:
    """Parse ``raw``, expecting an AFDConfigError whose message matches."""
    with pytest.raises(AFDConfigError, match=pattern) as info:
        parse_afd_config(raw)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, AFDError)
    return info.value


def _cfg(**overrides: Any) -> dict[str, Any]:
    return {"role": "attention", **overrides}


# -- defaults and happy paths --------------------------------------------------


def test_parse_minimal_config_fills_defaults() -> None:
    cfg = parse_afd_config({"role": "ffn"})
    assert cfg.role is AFDRole.FFN
    assert cfg.is_ffn and not cfg.is_attention
    assert cfg.connector == "p2p"
    assert cfg.host == "127.0.0.1"
    assert cfg.port == DEFAULT_PORT == 29650
    assert cfg.num_attention_ranks == 1
    assert cfg.num_ffn_ranks == 1
    assert cfg.compute_gate_on_attention is False
    assert cfg.num_ubatches == 1
    # The connector's defaults are filled in.
    assert dict(cfg.connector_extra_config) == {
        "timeout_s": 60.0,
        "connect_timeout_s": 600.0,
        "warmup_timeout_s": 600.0,
        "backend": "auto",
        "allow_time_slicing": False,
        "ipc_copy": "ce",
        "heartbeat_interval_s": 1.0,
        "secret_file": "",
    }


def test_parse_full_config_keeps_every_value() -> None:
    raw = {
        "role": "attention",
        "connector": "p2p",
        "host": "10.0.0.7",
        "port": 40000,
        "num_attention_ranks": 4,
        "num_ffn_ranks": 2,
        "compute_gate_on_attention": True,
        "connector_extra_config": {"timeout_s": 5, "backend": "gloo"},
        "num_ubatches": 2,
    }
    cfg = parse_afd_config(raw)
    assert cfg.num_ubatches == 2
    assert cfg.is_attention and not cfg.is_ffn
    assert (cfg.host, cfg.port) == ("10.0.0.7", 40000)
    assert (cfg.num_attention_ranks, cfg.num_ffn_ranks) == (4, 2)
    assert cfg.compute_gate_on_attention is True
    assert cfg.connector_extra_config["timeout_s"] == 5.0
    assert isinstance(cfg.connector_extra_config["timeout_s"], float)
    assert cfg.connector_extra_config["backend"] == "gloo"


def test_parse_accepts_any_mapping() -> None:
    cfg = parse_afd_config(MappingProxyType({"role": "ffn"}))
    assert cfg.role is AFDRole.FFN


def test_parse_returns_an_afd_config_unchanged() -> None:
    cfg = parse_afd_config({"role": "ffn"})
    assert parse_afd_config(cfg) is cfg


def test_parse_connector_alias_resolves_to_canonical_name() -> None:
    cfg = parse_afd_config(_cfg(connector="P2pNcclAFDConnector"))
    assert cfg.connector == "p2p"


@pytest.mark.parametrize("name", registered_names())
def test_parse_every_registered_connector_is_accepted(name: str) -> None:
    assert parse_afd_config(_cfg(connector=name)).connector == name


@pytest.mark.parametrize(("a", "f"), [(1, 1), (2, 1), (4, 2), (6, 3), (64, 16)])
def test_parse_valid_rank_counts_are_accepted(a: int, f: int) -> None:
    cfg = parse_afd_config(_cfg(num_attention_ranks=a, num_ffn_ranks=f))
    assert (cfg.num_attention_ranks, cfg.num_ffn_ranks) == (a, f)


@pytest.mark.parametrize("port", [1, 65534])
def test_parse_port_bounds_are_accepted(port: int) -> None:
    assert parse_afd_config(_cfg(port=port)).port == port


def test_config_is_frozen() -> None:
    cfg = parse_afd_config({"role": "ffn"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.connector_extra_config["timeout_s"] = 1.0  # type: ignore[index]


def test_config_does_not_alias_the_raw_extra_config() -> None:
    extra = {"timeout_s": 3.0}
    cfg = parse_afd_config(_cfg(connector_extra_config=extra))
    extra["timeout_s"] = 99.0
    assert cfg.connector_extra_config["timeout_s"] == 3.0


@pytest.mark.parametrize(
    "raw",
    [
        {"role": "ffn"},
        {
            "role": "attention",
            "connector": "P2pNcclAFDConnector",
            "host": "node0",
            "port": 1234,
            "num_attention_ranks": 6,
            "num_ffn_ranks": 3,
            "compute_gate_on_attention": True,
            "connector_extra_config": {"connect_timeout_s": 30, "backend": "nccl"},
        },
        {"role": "ffn", "connector": "loopback"},
        {"role": "attention", "num_ubatches": 2},
    ],
)
def test_to_dict_round_trips_through_parse(raw: dict[str, Any]) -> None:
    cfg = parse_afd_config(raw)
    plain = cfg.to_dict()
    assert type(plain["connector_extra_config"]) is dict
    assert plain["role"] in ("attention", "ffn")
    again = parse_afd_config(plain)
    assert again == cfg
    assert again.to_dict() == plain


def test_afd_config_from_additional_without_afd_key_returns_none() -> None:
    assert afd_config_from_additional({}) is None
    assert afd_config_from_additional({"other_plugin": {"x": 1}}) is None
    assert afd_config_from_additional(None) is None


def test_afd_config_from_additional_with_afd_key_parses_it() -> None:
    cfg = afd_config_from_additional({AFD_KEY: {"role": "ffn"}, "other": 1})
    assert cfg is not None and cfg.role is AFDRole.FFN


def test_afd_config_from_additional_with_bad_afd_key_raises() -> None:
    with pytest.raises(AFDConfigError, match="must be a JSON object"):
        afd_config_from_additional({AFD_KEY: "attention"})


# -- phase 1 errors -------------------------------------------------------------


@pytest.mark.parametrize("raw", ["attention", ["role", "ffn"], 3, None])
def test_parse_not_a_mapping_raises(raw: Any) -> None:
    _raises(raw, r'additional_config\["afd"\] must be a JSON object, got')


@pytest.mark.parametrize(
    ("key", "suggestion"),
    [
        ("num_atention_ranks", "num_attention_ranks"),
        ("num_ffn_rank", "num_ffn_ranks"),
        ("rol", "role"),
        ("connecter", "connector"),
        ("compute_gate_on_attn", "compute_gate_on_attention"),
    ],
)
def test_parse_unknown_key_suggests_closest_name(key: str, suggestion: str) -> None:
    err = _raises(_cfg(**{key: 1}), f"unknown key afd.{key}")
    assert f"did you mean {suggestion!r}?" in str(err)
    assert "Valid keys: " in str(err)
    assert "num_attention_ranks" in str(err)


def test_parse_unknown_key_without_close_match_lists_valid_keys() -> None:
    err = _raises(_cfg(zzzzzz=1), "unknown key afd.zzzzzz")
    assert "did you mean" not in str(err)
    assert "Valid keys: attention_ranks_per_device, compute_gate_on_attention" in str(
        err
    )


@pytest.mark.parametrize(
    ("key", "value", "type_name", "want"),
    [
        ("num_attention_ranks", True, "bool", "an integer"),
        ("num_ffn_ranks", False, "bool", "an integer"),
        ("port", 29650.0, "float", "an integer"),
        ("num_attention_ranks", 2.0, "float", "an integer"),
        ("port", "29650", "str", "an integer"),
        ("compute_gate_on_attention", "true", "str", "true or false"),
        ("compute_gate_on_attention", 1, "int", "true or false"),
        ("host", 127, "int", "a string"),
        ("connector", 1, "int", "a string"),
        ("role", None, "NoneType", "a string"),
        ("connector_extra_config", ["timeout_s", 1], "list", "a JSON object"),
        ("connector_extra_config", "timeout_s=1", "str", "a JSON object"),
    ],
)
def test_parse_wrong_type_raises_naming_key_value_and_type(
    key: str, value: Any, type_name: str, want: str
) -> None:
    _raises(
        _cfg(**{key: value}),
        re.escape(f"afd.{key}={value!r} has type {type_name}; it must be {want}"),
    )


def test_parse_missing_role_raises() -> None:
    _raises({"num_attention_ranks": 2}, 'afd.role is required: set "role"')


@pytest.mark.parametrize("role", ["Attention", "ffn ", "prefill", ""])
def test_parse_bad_role_raises(role: str) -> None:
    _raises(
        {"role": role},
        re.escape(f"afd.role={role!r} is not a role; use 'attention' or 'ffn'"),
    )


@pytest.mark.parametrize("name", ["nccl", "p2p_nccl", "P2P", ""])
def test_parse_unknown_connector_lists_registered_names(name: str) -> None:
    err = _raises(_cfg(connector=name), re.escape(f"afd.connector={name!r}"))
    message = str(err)
    assert "not a registered connector" in message
    for registered in registered_names():
        assert registered in message
    assert "P2pNcclAFDConnector" in message


@pytest.mark.parametrize("host", ["", "   "])
def test_parse_empty_host_raises(host: str) -> None:
    _raises(
        _cfg(host=host),
        re.escape(f"afd.host={host!r} is empty; give the address of FFN rank 0"),
    )


@pytest.mark.parametrize("port", [0, -1, 65535, 65536, 100000])
def test_parse_port_out_of_range_raises(port: int) -> None:
    _raises(
        _cfg(port=port),
        re.escape(f"afd.port={port} is outside 1..65534 (afd.port + 1 is used too)"),
    )


@pytest.mark.parametrize("n", [0, -1, 3, 8])
def test_parse_num_ubatches_out_of_range_raises(n: int) -> None:
    _raises(
        _cfg(num_ubatches=n),
        re.escape(f"afd.num_ubatches={n} is outside 1..2; 2 gives dual-batch"),
    )


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("num_attention_ranks", 0),
        ("num_attention_ranks", -2),
        ("num_ffn_ranks", 0),
        ("num_ffn_ranks", -1),
    ],
)
def test_parse_non_positive_rank_count_raises(key: str, value: int) -> None:
    _raises(_cfg(**{key: value}), re.escape(f"afd.{key}={value} must be at least 1"))


@pytest.mark.parametrize(("a", "f"), [(1, 2), (2, 4), (3, 8)])
def test_parse_fewer_attention_than_ffn_ranks_raises(a: int, f: int) -> None:
    _raises(
        _cfg(num_attention_ranks=a, num_ffn_ranks=f),
        re.escape(
            f"afd.num_attention_ranks={a} must be >= afd.num_ffn_ranks={f}; "
            "each FFN rank serves at least one attention rank"
        ),
    )


@pytest.mark.parametrize(("a", "f"), [(3, 2), (5, 3), (10, 4)])
def test_parse_accepts_attention_ranks_not_multiple_of_ffn_ranks(
    a: int, f: int
) -> None:
    cfg = parse_afd_config(
        {"role": "attention", "num_attention_ranks": a, "num_ffn_ranks": f}
    )
    assert (cfg.num_attention_ranks, cfg.num_ffn_ranks) == (a, f)


def test_parse_unknown_connector_extra_key_names_valid_keys() -> None:
    err = _raises(
        _cfg(connector_extra_config={"timeout": 5}),
        re.escape(
            "afd.connector_extra_config.timeout is not an option of connector 'p2p'"
        ),
    )
    assert (
        "valid keys: allow_time_slicing, backend, connect_timeout_s, "
        "heartbeat_interval_s, ipc_copy, secret_file, timeout_s" in str(err)
    )


def test_parse_loopback_connector_rejects_p2p_only_extra_key() -> None:
    _raises(
        _cfg(connector="loopback", connector_extra_config={"backend": "gloo"}),
        "afd.connector_extra_config.backend is not an option of connector 'loopback'",
    )


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        ({"timeout_s": "5"}, "timeout_s='5' has type str; it must be a number"),
        ({"timeout_s": True}, "timeout_s=True has type bool; it must be a number"),
        ({"timeout_s": 0}, "timeout_s=0 must be > 0 seconds"),
        ({"connect_timeout_s": -1.0}, "connect_timeout_s=-1.0 must be > 0 seconds"),
        ({"timeout_s": float("inf")}, "timeout_s=inf must be a finite number"),
        ({"timeout_s": float("-inf")}, "timeout_s=-inf must be a finite number"),
        ({"timeout_s": float("nan")}, "timeout_s=nan must be a finite number"),
        ({"warmup_timeout_s": 9e13}, "at most 604800 (7 days)"),
        ({"backend": 1}, "backend=1 has type int; it must be a string"),
        ({"backend": "mpi"}, "backend='mpi' is not one of auto, gloo, nccl"),
    ],
)
def test_parse_bad_connector_extra_value_raises(
    extra: dict[str, Any], pattern: str
) -> None:
    _raises(_cfg(connector_extra_config=extra), re.escape(pattern))


def test_parse_infinity_from_json_is_refused_naming_the_key() -> None:
    # JSON parsers accept Infinity and NaN; the config must not.
    raw = json.loads(
        '{"role": "ffn", "connector_extra_config": {"timeout_s": Infinity}}'
    )
    _raises(raw, re.escape("afd.connector_extra_config.timeout_s=inf"))


@pytest.mark.parametrize("key", ["timeout_s", "connect_timeout_s", "backend"])
def test_parse_connector_option_at_top_level_says_where_it_belongs(key) -> None:
    err = _raises(_cfg(**{key: 10}), f"unknown key afd.{key}")
    assert "put it under afd.connector_extra_config" in str(err)


def test_parse_afd_key_inside_connector_extra_config_says_where_it_belongs():
    err = _raises(
        _cfg(connector_extra_config={"num_ffn_ranks": 2}),
        "afd.connector_extra_config.num_ffn_ranks is not an option",
    )
    assert "put it at afd.num_ffn_ranks" in str(err)


def test_parse_checks_role_before_ranges() -> None:
    # A missing role is reported even when other values are also wrong.
    _raises({"port": 0}, "afd.role is required")


def test_afd_config_direct_construction_defaults_match_parse() -> None:
    direct = AFDConfig(role=AFDRole.ATTENTION)
    parsed = parse_afd_config({"role": "attention", "connector": "p2p"})
    for field in ("connector", "host", "port", "num_attention_ranks"):
        assert getattr(direct, field) == getattr(parsed, field)
    assert direct.num_ffn_ranks == parsed.num_ffn_ranks
    assert direct.compute_gate_on_attention == parsed.compute_gate_on_attention


# -- rank (FFN servers) --------------------------------------------------------


def test_parse_rank_accepted_on_ffn_role_within_num_ffn_ranks() -> None:
    cfg = parse_afd_config(
        {"role": "ffn", "num_attention_ranks": 4, "num_ffn_ranks": 2, "rank": 1}
    )
    assert cfg.rank == 1
    assert parse_afd_config(cfg.to_dict()) == cfg


def test_parse_rank_rejected_on_attention_role_naming_data_parallel() -> None:
    with pytest.raises(AFDConfigError, match=r"afd.rank=0 is for the FFN role only"):
        parse_afd_config({"role": "attention", "rank": 0})


@pytest.mark.parametrize("rank", [-1, 2])
def test_parse_rank_outside_num_ffn_ranks_rejected(rank: int) -> None:
    with pytest.raises(AFDConfigError, match=rf"afd.rank={rank} is outside 0..1"):
        parse_afd_config(
            {"role": "ffn", "num_attention_ranks": 2, "num_ffn_ranks": 2, "rank": rank}
        )


def test_parse_rank_required_on_ffn_role_with_several_ffn_ranks() -> None:
    with pytest.raises(AFDConfigError, match=r"afd.rank is required .* afd.rank=0..1"):
        parse_afd_config({"role": "ffn", "num_attention_ranks": 2, "num_ffn_ranks": 2})


def test_attention_ranks_per_device_parses_and_round_trips() -> None:
    cfg = parse_afd_config(
        _cfg(num_attention_ranks=4, num_ffn_ranks=2, attention_ranks_per_device=2)
    )
    assert cfg.attention_ranks_per_device == 2
    assert parse_afd_config(cfg.to_dict()) == cfg
    assert "attention_ranks_per_device" not in parse_afd_config(_cfg()).to_dict()


@pytest.mark.parametrize("k", [0, -1, 3])
def test_attention_ranks_per_device_outside_the_ranks_raises(k: int) -> None:
    _raises(
        _cfg(num_attention_ranks=2, attention_ranks_per_device=k),
        re.escape(
            f"afd.attention_ranks_per_device={k} is outside 1..2 "
            "(afd.num_attention_ranks=2)"
        ),
    )


def test_attention_ranks_per_device_on_the_ffn_role_raises() -> None:
    _raises(
        {"role": "ffn", "num_attention_ranks": 2, "attention_ranks_per_device": 2},
        re.escape("afd.attention_ranks_per_device=2 is for the attention role only"),
    )
