"""Attention ranks sharing a GPU: the rank placement, the group and all-to-all
replacements, and their patches against the installed vLLM. The GPU test
(``tests/gpu/test_scale_out_gpu.py``) runs 2A1F with both ranks on one GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.distributed import parallel_state  # noqa: E402
from vllm.v1.worker.gpu import model_runner  # noqa: E402

from vllm_afd.compat.patching import check_patch  # noqa: E402
from vllm_afd.worker.device_sharing import (  # noqa: E402
    EP_ALL2ALL_MANAGER,
    MODEL_PARALLEL_GROUP,
    NO_ALL2ALL,
    _all2all_of_host_only_ep,
    _host_only_groups,
    shared_device_rank,
    sharing_devices,
)


@pytest.mark.parametrize("patch", [MODEL_PARALLEL_GROUP, EP_ALL2ALL_MANAGER])
def test_patches_match_the_installed_vllm(patch) -> None:
    check_patch(patch)


@pytest.mark.parametrize(
    ("rank", "per_device", "device_rank"),
    [(0, 2, 0), (1, 2, 0), (2, 2, 1), (3, 2, 1), (5, 3, 1), (3, 1, 3)],
)
def test_consecutive_ranks_share_the_devices_of_one_rank(
    rank: int, per_device: int, device_rank: int
) -> None:
    assert shared_device_rank(rank, per_device) == device_rank


def _worker(local: int | None, index: int) -> SimpleNamespace:
    parallel = SimpleNamespace(
        data_parallel_rank_local=local, data_parallel_index=index
    )
    return SimpleNamespace(parallel_config=parallel)


def test_sharing_presents_the_device_rank_during_init_and_restores_it() -> None:
    native_groups = parallel_state.init_model_parallel_group
    native_all2all = model_runner.get_ep_all2all_manager
    worker = _worker(3, 3)
    with sharing_devices(worker, 2):
        assert worker.parallel_config.data_parallel_rank_local == 1
        assert parallel_state.init_model_parallel_group is not native_groups
        assert model_runner.get_ep_all2all_manager is not native_all2all
    assert worker.parallel_config.data_parallel_rank_local == 3
    assert parallel_state.init_model_parallel_group is native_groups
    assert model_runner.get_ep_all2all_manager is native_all2all
    # No local rank (one node): vLLM falls back to the DP index; so does this.
    worker = _worker(None, 1)
    with pytest.raises(RuntimeError, match="boom"), sharing_devices(worker, 2):
        assert worker.parallel_config.data_parallel_rank_local == 0
        raise RuntimeError("boom")
    assert worker.parallel_config.data_parallel_rank_local is None


def test_one_rank_per_device_changes_nothing() -> None:
    native = parallel_state.init_model_parallel_group
    worker = _worker(1, 1)
    with sharing_devices(worker, 1):
        assert worker.parallel_config.data_parallel_rank_local == 1
        assert parallel_state.init_model_parallel_group is native


def test_dp_and_ep_groups_are_built_without_a_device_communicator() -> None:
    calls = []

    def original(*args, **kwargs):
        calls.append(kwargs)

    groups = _host_only_groups(original)
    for name in ("dp", "ep", "eplb", "tp", "pp"):
        groups([[0, 1]], 0, "nccl", group_name=name)
    device = [c.get("use_device_communicator", True) for c in calls]
    assert device == [False, False, False, True, True]


def test_ep_without_device_communicator_reports_no_fault_tolerance() -> None:
    real = SimpleNamespace(support_fault_tolerance=True)
    all2all = _all2all_of_host_only_ep(lambda ep_group=None: real)
    host_only = SimpleNamespace(device_communicator=None)
    assert all2all(host_only) is NO_ALL2ALL
    assert NO_ALL2ALL.support_fault_tolerance is False
    assert all2all(SimpleNamespace(device_communicator=object())) is real
