"""The ``p2p`` connector (alias ``P2pNcclAFDConnector``).

Control plane: plain TCP (``p2p_control``, ``p2p_rendezvous``); ffn rank 0
listens on ``afd.host:afd.port``. Data plane: a private Gloo (CPU tensors) or
NCCL (CUDA tensors) process group (``p2p_data``) on a ``TCPStore`` at
``afd.port + 1``, or, for CUDA endpoints of one host, buffers shared by CUDA
IPC with flags on the device (``ipc_data``).

Options (``connector_extra_config``): ``timeout_s`` (60), ``warmup_timeout_s``
(600), ``connect_timeout_s`` (600), ``backend`` (``auto`` | ``gloo`` | ``nccl`` |
``cuda_ipc``, see ``ipc_data``), ``allow_time_slicing`` (false), ``ipc_copy``
(``ce`` | ``sm``),
``heartbeat_interval_s`` (1), ``secret_file`` (none; or the ``AFD_SECRET``
variable, see ``connector.auth``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_afd.connector import auth
from vllm_afd.connector.connector import AFDConnector
from vllm_afd.connector.data import DataPlane
from vllm_afd.connector.factory import ExchangeLimits
from vllm_afd.connector.p2p_control import P2PControlPlane
from vllm_afd.connector.p2p_data import P2PDataPlane
from vllm_afd.errors import AFDConfigError

if TYPE_CHECKING:
    import torch

    from vllm_afd.config import AFDConfig
    from vllm_afd.connector.protocol import Fingerprint
    from vllm_afd.topology import Topology


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` -> ``nccl`` for CUDA devices, ``gloo`` otherwise (``vllm-afd
    launch`` asks for ``cuda_ipc`` itself when both roles share a GPU)."""
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    want = "cpu" if backend == "gloo" else "cuda"
    if device.type != want:
        raise AFDConfigError(
            f"afd.connector_extra_config.backend={backend!r} moves {want} tensors, "
            f"but the connector device is {device}; use backend 'auto'"
        )
    return backend


def build(
    config: AFDConfig,
    role_rank: int,
    fingerprint: Fingerprint,
    device: torch.device,
    topology: Topology,
    extra: dict[str, Any],
    limits: ExchangeLimits,
) -> AFDConnector:
    """Factory hook for ``p2p``."""
    backend = resolve_backend(extra["backend"], device)
    timeout_s, connect_timeout_s = extra["timeout_s"], extra["connect_timeout_s"]
    control = P2PControlPlane(
        host=config.host,
        port=config.port,
        topology=topology,
        role=config.role,
        role_rank=role_rank,
        timeout_s=timeout_s,
        warmup_timeout_s=max(timeout_s, extra["warmup_timeout_s"]),
        connect_timeout_s=connect_timeout_s,
        secret=auth.load_secret(extra["secret_file"]),
        heartbeat_interval_s=extra["heartbeat_interval_s"],
    )
    if backend == "cuda_ipc":
        data = _ipc_plane(
            config, role_rank, fingerprint, device, topology, extra, limits
        )
    else:
        data = P2PDataPlane(
            host=config.host,
            store_port=config.port + 1,
            global_rank=topology.global_rank(config.role, role_rank),
            world_size=topology.world_size,
            backend=backend,
            timeout_s=max(timeout_s, extra["warmup_timeout_s"]),
            connect_timeout_s=connect_timeout_s,
            gpu=_gpu_uuid(device) if backend == "nccl" else "",
        )
    return AFDConnector.assemble(
        "p2p", config, role_rank, topology, fingerprint, device, extra,
        control, data,
    )  # fmt: skip


def _ipc_plane(
    config: AFDConfig,
    role_rank: int,
    fingerprint: Fingerprint,
    device: torch.device,
    topology: Topology,
    extra: dict[str, Any],
    limits: ExchangeLimits,
) -> DataPlane:
    from vllm_afd.connector.core import torch_dtype
    from vllm_afd.connector.ipc_data import CudaIpcDataPlane
    from vllm_afd.connector.ipc_layout import Shapes

    peers = topology.peer_global_ranks(config.role, role_rank)
    shapes = Shapes(
        max_tokens=limits.max_tokens,
        ubatches=limits.ubatches,
        hidden=fingerprint.hidden_size,
        itemsize=torch_dtype(fingerprint.dtype).itemsize,
        top_k=fingerprint.top_k,
        gate=fingerprint.compute_gate_on_attention,
        moe_output_parts=fingerprint.moe_output_parts,
    )
    return CudaIpcDataPlane(
        role=config.role,
        peers=peers,
        device=_cuda_device(device),
        shapes=shapes,
        timeout_s=extra["timeout_s"],
        allow_time_slicing=extra["allow_time_slicing"],
        copy=extra["ipc_copy"],
    )


def _cuda_device(device: torch.device) -> torch.device:
    """``device`` with its index (``cuda`` alone: the current device)."""
    import torch

    if device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device())


def _gpu_uuid(device: torch.device) -> str:
    import torch

    return str(torch.cuda.get_device_properties(_cuda_device(device)).uuid)
