"""How co-located role processes share a host's RAM or a GPU (no servers)."""

from __future__ import annotations

import pytest

from vllm_afd.deploy import DeploymentSpec, memory, role_processes
from vllm_afd.deploy import commands as commands_mod
from vllm_afd.deploy.memory import (
    CPU_PROCESS_BYTES,
    KV_SHARE,
    MAX_AUTO_KV_BYTES,
    MIN_KV_BYTES,
    GiB,
    MemoryBudgetError,
    cpu_budget,
    gpu_budget,
    sets_memory,
)


def _kv(budget) -> int:
    args = budget.attention_args
    return int(args[args.index("--kv-cache-memory-bytes") + 1])


@pytest.mark.parametrize("room", [None, GiB], ids=["capped", "split"])
@pytest.mark.parametrize("attention,ffn", [(1, 1), (2, 1), (3, 1), (2, 2)])
def test_cpu_budget_splits_what_is_left_over_the_attention_workers(
    attention, ffn, room
):
    """``room``: RAM left beside the role processes (None: what the 24 GiB CI
    host had free, where every share is capped)."""
    weights = 5 * 2**20
    reserved = CPU_PROCESS_BYTES * (attention + ffn) + weights * (1 + ffn)
    available = int(20.93 * GiB) if room is None else reserved + room
    budget = cpu_budget(
        attention_workers=attention, ffn_workers=ffn,
        weight_bytes=weights, available=available,
    )  # fmt: skip
    kv = _kv(budget)
    share = (available - reserved) * KV_SHARE / attention
    assert kv == pytest.approx(min(share, MAX_AUTO_KV_BYTES), abs=2**20)
    assert (kv < MAX_AUTO_KV_BYTES) == (room is not None)
    # Everything asked for fits in what was available, with room to spare.
    assert attention * kv + reserved < available
    assert budget.ffn_args == ()  # the FFN role holds no KV cache
    assert "KV cache" in budget.note and "GiB per attention worker" in budget.note


def test_cpu_budget_that_cannot_fit_is_refused_with_the_numbers():
    with pytest.raises(MemoryBudgetError) as err:
        cpu_budget(
            attention_workers=2, ffn_workers=2,
            weight_bytes=2 * GiB, available=16 * GiB,
        )  # fmt: skip
    text = str(err.value)
    assert "16.0 GiB of RAM available" in text and "4 role worker(s)" in text
    assert f"at least {MIN_KV_BYTES // 2**20} MiB" in text
    assert "--kv-cache-memory-bytes" in text


@pytest.mark.parametrize(
    "weights_gib,ffn,attention",
    [(0.01, "0.05", "0.85"), (60, "0.45", "0.45"), (10, "0.09", "0.81")],
)
def test_gpu_budget_gives_the_ffn_its_weights_and_attention_the_rest(
    weights_gib, ffn, attention
):
    budget = gpu_budget(
        ffn_per_gpu=1, attention_per_gpu=1, weight_bytes=int(weights_gib * GiB),
        total=140 * GiB, attention_set=False, ffn_set=False,
    )  # fmt: skip
    assert budget.ffn_args == ("--gpu-memory-utilization", ffn)
    assert budget.attention_args == ("--gpu-memory-utilization", attention)
    assert float(ffn) + float(attention) <= 0.9 + 1e-9


def test_gpu_budget_keeps_what_the_user_set_and_refuses_what_cannot_fit():
    kept = gpu_budget(
        ffn_per_gpu=1, attention_per_gpu=2, weight_bytes=GiB, total=80 * GiB,
        attention_set=True, ffn_set=False,
    )  # fmt: skip
    assert kept.attention_args == () and kept.ffn_args
    with pytest.raises(MemoryBudgetError, match="one GPU cannot hold 1 FFN rank"):
        gpu_budget(
            ffn_per_gpu=1, attention_per_gpu=1, weight_bytes=130 * GiB,
            total=140 * GiB, attention_set=False, ffn_set=False,
        )  # fmt: skip
    # Attention ranks sharing a GPU without the FFN: 0.9 split between them.
    alone = gpu_budget(
        ffn_per_gpu=0, attention_per_gpu=2, weight_bytes=GiB, total=None,
        attention_set=False, ffn_set=False,
    )  # fmt: skip
    assert alone.attention_args == ("--gpu-memory-utilization", "0.45")


@pytest.mark.parametrize(
    "args,given",
    [
        (["--kv-cache-memory-bytes", "1G"], True),
        (["--gpu-memory-utilization=0.5"], True),
        (["--max-model-len", "512"], False),
    ],
)
def test_sets_memory_sees_either_flag_in_both_spellings(args, given):
    assert sets_memory(args) is given


def _argv(spec, name):
    return next(p.argv for p in role_processes(spec) if p.name == name)


def test_launch_on_a_cpu_host_sizes_the_attention_kv_cache_unless_the_user_did(
    monkeypatch,
):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(commands_mod, "available_ram", lambda: 20 * GiB)
    spec = DeploymentSpec(model="m", cpu_workaround=True)
    assert "--kv-cache-memory-bytes" in _argv(spec, "attention")
    assert "--kv-cache-memory-bytes" not in _argv(spec, "ffn")
    mine = DeploymentSpec(
        model="m", cpu_workaround=True, attention_args=["--kv-cache-memory-bytes", "2G"]
    )
    assert _argv(mine, "attention").count("--kv-cache-memory-bytes") == 1
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert "--kv-cache-memory-bytes" not in _argv(spec, "attention")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    monkeypatch.setattr(commands_mod, "available_ram", lambda: 4 * GiB)
    with pytest.raises(MemoryBudgetError, match="4.0 GiB of RAM available"):
        role_processes(spec)


def test_roles_sharing_one_gpu_each_get_a_utilization(monkeypatch):
    monkeypatch.setattr(commands_mod, "gpu_total_bytes", lambda device: 140 * GiB)
    spec = DeploymentSpec(
        model="m", cpu_workaround=False, attention_devices="0", ffn_devices="0"
    )
    ffn, attention = _argv(spec, "ffn"), _argv(spec, "attention")
    assert ffn[ffn.index("--gpu-memory-utilization") + 1] == "0.05"
    assert attention[attention.index("--gpu-memory-utilization") + 1] == "0.85"
    apart = DeploymentSpec(
        model="m", cpu_workaround=False, attention_devices="0", ffn_devices="1"
    )
    assert "--gpu-memory-utilization" not in _argv(apart, "attention")


@pytest.mark.parametrize(
    "gpus,given,expected",
    [
        (["0"], {}, ("0", "0")),  # one GPU: both roles on it (cuda_ipc)
        (["3"], {}, ("3", "3")),  # the one CUDA_VISIBLE_DEVICES leaves
        (["0", "1"], {}, (None, None)),  # several: left to the user
        ([], {}, (None, None)),  # a CPU host
        (["0"], {"ffn_devices": "0"}, (None, "0")),  # a list given: kept
        # every FFN rank on it (async: the FFN ranks split the experts)
        (["0"], {"ffn_ranks": 2, "connector": "async"}, ("0", "0,0")),
    ],
)
def test_a_one_gpu_host_puts_both_roles_on_its_gpu(gpus, given, expected):
    spec = DeploymentSpec(model="m", **given).with_default_devices(gpus)
    assert (spec.attention_devices, spec.ffn_devices) == expected
    if expected == ("0", "0"):
        assert spec.data_plane() == "cuda_ipc"
    if spec.connector == "async":
        assert spec.data_plane() == "tcp"  # host memory over TCP on any device
        assert spec.role_devices() == ("0", ["0", "0"])
        assert "backend" not in spec.afd_config("ffn")["connector_extra_config"]


def test_a_checkpoint_without_weight_files_is_sized_from_its_config(tmp_path):
    """``--load-format dummy`` reads no files: the budget counts the weights
    the config describes, within a few percent of what the files would hold."""
    from vllm_afd.models.tiny_checkpoint import write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "m", arch="qwen3_moe", num_layers=2)
    files = memory.checkpoint_bytes(str(model))
    for f in model.glob("*.safetensors"):
        f.unlink()
    described = memory.checkpoint_bytes(str(model))
    assert described == pytest.approx(files, rel=0.05)
    (model / "config.json").write_text('{"model_type": "no-such-family"}')
    assert memory.checkpoint_bytes(str(model)) == 0
