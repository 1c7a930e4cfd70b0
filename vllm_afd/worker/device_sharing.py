"""Several attention ranks on one GPU (``afd.attention_ranks_per_device = k``).

Attention ranks are vLLM data-parallel ranks of one ``vllm serve``. vLLM's
GPU worker puts local DP rank ``r`` on the visible devices
``[r*W, (r+1)*W)`` (``W``: the rank's TP x PP world). With ``k > 1`` rank
``r`` takes the devices of rank ``r // k`` instead, so ``k`` consecutive
ranks share them: 2A1F on two GPUs is both attention ranks on GPU 0 and the
FFN on GPU 1.

NCCL refuses a communicator with two ranks on one GPU ("Duplicate GPU
detected"), and vLLM builds one over its DP group and its EP group. The
attention role uses neither on the device: it holds no experts, and the V2
runner coordinates its DP ranks over the CPU group. Those groups are built
without a device communicator. The connector is unaffected: its NCCL
point-to-point pairs join an attention rank with an FFN rank, never two
attention ranks.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from vllm_afd.compat.patching import Patch, check_patch, scoped_patch

MODEL_PARALLEL_GROUP = Patch(
    target="vllm.distributed.parallel_state:init_model_parallel_group",
    expected_params=(
        "group_ranks",
        "local_rank",
        "backend",
        "use_message_queue_broadcaster",
        "group_name",
        "use_device_communicator",
        "use_all2all",
    ),
    reason="attention ranks sharing a GPU: vLLM's DP and EP groups would get "
    "NCCL communicators with two ranks on one device, which NCCL refuses",
    removal="when vLLM can place several data-parallel ranks on one device",
)

EP_ALL2ALL_MANAGER = Patch(
    target="vllm.v1.worker.gpu.model_runner:get_ep_all2all_manager",
    expected_params=("ep_group",),
    reason="attention ranks sharing a GPU: the V2 runner asks the EP group's "
    "all-to-all (which has no device communicator there) about fault tolerance",
    removal="with MODEL_PARALLEL_GROUP",
)

#: what the V2 runner learns from an EP group without a device communicator
NO_ALL2ALL = SimpleNamespace(support_fault_tolerance=False)

#: vLLM groups across data-parallel ranks that the attention role never
#: uses on the device
HOST_ONLY_GROUPS = frozenset({"dp", "ep", "eplb"})


def shared_device_rank(local_dp_rank: int, ranks_per_device: int) -> int:
    """The local DP rank whose devices rank ``local_dp_rank`` runs on."""
    return local_dp_rank // ranks_per_device


@contextlib.contextmanager
def sharing_devices(worker: Any, ranks_per_device: int) -> Iterator[None]:
    """Around the native ``init_device``: put this DP rank on the devices of
    rank ``r // ranks_per_device`` and build the DP/EP groups without device
    communicators. Nothing changes when ``ranks_per_device`` is 1."""
    if ranks_per_device == 1:
        yield
        return
    parallel = worker.parallel_config
    saved = parallel.data_parallel_rank_local
    local = saved if saved is not None else parallel.data_parallel_index
    parallel.data_parallel_rank_local = shared_device_rank(local, ranks_per_device)
    try:
        groups = _host_only_groups(check_patch(MODEL_PARALLEL_GROUP))
        all2all = _all2all_of_host_only_ep(check_patch(EP_ALL2ALL_MANAGER))
        with (
            scoped_patch(MODEL_PARALLEL_GROUP, groups),
            scoped_patch(EP_ALL2ALL_MANAGER, all2all),
        ):
            yield
    finally:
        parallel.data_parallel_rank_local = saved


def _host_only_groups(original: Any) -> Any:
    @functools.wraps(original)
    def init_model_parallel_group(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("group_name") in HOST_ONLY_GROUPS:
            kwargs["use_device_communicator"] = False
        return original(*args, **kwargs)

    return init_model_parallel_group


def _all2all_of_host_only_ep(original: Any) -> Any:
    @functools.wraps(original)
    def get_ep_all2all_manager(ep_group: Any = None) -> Any:
        from vllm.distributed.parallel_state import get_ep_group

        group = ep_group if ep_group is not None else get_ep_group()
        if group.device_communicator is None:
            return NO_ALL2ALL
        return original(ep_group)

    return get_ep_all2all_manager
