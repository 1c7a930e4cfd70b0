"""What to launch: :class:`DeploymentSpec` (topology, ports, devices,
hosts, supervision) and the readers of vLLM arguments it needs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_afd.config import DEFAULT_PORT
from vllm_afd.deploy.memory import nvidia_smi
from vllm_afd.deploy.placement import Placement, PlacementError
from vllm_afd.deploy.process import LaunchError


@dataclass
class DeploymentSpec:
    """What to launch.

    ``vllm_args`` go to every role process (and to the plain baseline);
    ``attention_args`` / ``ffn_args`` only to that role (e.g. its
    ``--tensor-parallel-size``). ``attention_devices`` / ``ffn_devices`` are
    comma-separated GPU lists (``CUDA_VISIBLE_DEVICES``) for the attention
    server and for the FFN ranks, which split theirs into equal consecutive
    groups, rank k the k-th; None leaves the environment's. An attention
    list shorter than the attention ranks need puts several ranks on each
    GPU (:meth:`attention_ranks_per_device`).
    """

    model: str
    attention_ranks: int = 1
    ffn_ranks: int = 1
    port: int = 8000
    ffn_port: int | None = None
    afd_port: int = DEFAULT_PORT
    host: str = "127.0.0.1"
    api_host: str | None = None  # None: 127.0.0.1, across hosts the node's
    connector: str = "p2p"
    gate_on_attention: bool = False
    ubatches: int = 1
    connector_extra_config: dict = field(default_factory=dict)
    vllm_args: list[str] = field(default_factory=list)
    attention_args: list[str] = field(default_factory=list)
    ffn_args: list[str] = field(default_factory=list)
    attention_devices: str | None = None
    ffn_devices: str | None = None
    cpu_workaround: bool | None = None  # None: when no CUDA device is visible
    # CPU: "vllm" lets vLLM bind each role process's threads itself (every
    # role on the same cores); "split" gives each role process cores of its
    # own (``commands.split_cores``)
    cpu_bind: str = "vllm"
    # across hosts (``vllm_afd.deploy.placement``); None: everything on this one
    hosts: tuple[str, ...] | None = None
    node_rank: int = 0
    attention_nodes: tuple[int, ...] | None = None
    ffn_nodes: tuple[int, ...] | None = None
    dp_rpc_port: int | None = None  # None: afd_port + 2
    # supervision (Deployment.supervise)
    ffn_restarts: int = 10
    ffn_health_timeout_s: float = 30.0
    ready_timeout_s: float = 600.0

    def placement(self) -> Placement:
        """Node of every rank (everything on node 0 without ``hosts``).

        Raises:
            PlacementError: see :meth:`Placement.make`.
        """
        if self.hosts is None:
            return Placement.single(self.attention_ranks, self.ffn_ranks)
        return Placement.make(
            self.hosts, self.attention_ranks, self.ffn_ranks,
            self.attention_nodes, self.ffn_nodes,
        )  # fmt: skip

    @property
    def multi_host(self) -> bool:
        return self.hosts is not None and len(self.hosts) > 1

    def node_api_host(self, node: int) -> str:
        """What the API servers of ``node`` bind when ``api_host`` is unset."""
        if self.api_host is not None:
            return self.api_host
        return self.placement().hosts[node] if self.multi_host else "127.0.0.1"

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, vllm_args: list[str]
    ) -> DeploymentSpec:
        """The spec described by the ``launch`` / ``bench`` command lines."""
        hosts = getattr(args, "hosts", None)
        return cls(
            model=args.model,
            hosts=tuple(hosts.split(",")) if hosts else None,
            node_rank=getattr(args, "resolved_node_rank", 0),
            attention_nodes=_nodes(getattr(args, "attention_nodes", None)),
            ffn_nodes=_nodes(getattr(args, "ffn_nodes", None)),
            dp_rpc_port=getattr(args, "dp_rpc_port", None),
            attention_ranks=args.attention_ranks,
            ffn_ranks=args.ffn_ranks,
            port=args.port,
            ffn_port=args.ffn_port,
            afd_port=args.afd_port,
            host=getattr(args, "host", cls.host),
            api_host=getattr(args, "api_host", cls.api_host),
            connector=args.connector,
            gate_on_attention=args.gate_on_attention,
            ubatches=getattr(args, "ubatches", 1),
            cpu_bind=getattr(args, "cpu_bind", cls.cpu_bind),
            connector_extra_config=args.connector_extra_config,
            vllm_args=vllm_args,
            attention_args=getattr(args, "attention_args", []),
            ffn_args=getattr(args, "ffn_args", []),
            attention_devices=getattr(args, "attention_devices", None),
            ffn_devices=getattr(args, "ffn_devices", None),
            ffn_restarts=getattr(args, "ffn_restarts", cls.ffn_restarts),
            ffn_health_timeout_s=getattr(
                args, "ffn_health_timeout", cls.ffn_health_timeout_s
            ),
            ready_timeout_s=getattr(args, "ready_timeout", cls.ready_timeout_s),
        ).with_default_devices()

    def with_default_devices(self, gpus: list[str] | None = None) -> DeploymentSpec:
        """This spec, with both roles on the one GPU of a one-GPU host when no
        device list is given (``gpus``: the visible GPUs, default
        :func:`visible_gpus`): left to CUDA, every role would take GPU 0 as if
        alone, NCCL could not pair two ranks on it, and vLLM would give each
        role 0.9 of it. Given lists, several hosts, or another count of GPUs
        leave the spec as it is."""
        if self.attention_devices or self.ffn_devices or self.multi_host:
            return self
        if self.cpu_workaround:  # told it runs on CPU
            return self
        gpus = visible_gpus() if gpus is None else gpus
        if len(gpus) != 1:
            return self
        return dataclasses.replace(
            self,
            attention_devices=gpus[0],
            ffn_devices=",".join([gpus[0]] * self.ffn_ranks),  # one per FFN rank
        )

    def role_devices(self) -> tuple[str | None, list[str | None]]:
        """``CUDA_VISIBLE_DEVICES`` of the attention server and of each FFN
        rank (None: inherited).

        Raises:
            LaunchError: an empty entry, an FFN list that does not split
                evenly over the FFN ranks, or a GPU given to both roles over
                the NCCL data plane (it needs one GPU per connector rank).
        """
        attention = _device_list("--attention-devices", self.attention_devices)
        ffn = _device_list("--ffn-devices", self.ffn_devices)
        if ffn and len(ffn) % self.ffn_ranks:
            raise LaunchError(
                f"--ffn-devices lists {len(ffn)} devices for {self.ffn_ranks} FFN "
                "ranks; give every FFN rank the same number"
            )
        shared = self.shared_gpus()
        if shared and self.data_plane() == "nccl":
            raise LaunchError(
                f"GPU {','.join(shared)} is in both --attention-devices and "
                "--ffn-devices; the NCCL data plane needs each role on its own "
                "GPUs (the cuda_ipc one shares a GPU under MPS: backend "
                "'cuda_ipc' or 'auto' on one host)"
            )
        per_rank = len(ffn) // self.ffn_ranks if ffn else 0
        ffns = [
            ",".join(ffn[k * per_rank : (k + 1) * per_rank]) if ffn else None
            for k in range(self.ffn_ranks)
        ]
        return (",".join(attention) if attention else None), ffns

    def attention_ranks_per_device(self) -> int:
        """How many attention ranks share each attention device set: more
        than 1 when ``attention_devices`` lists fewer GPUs than the ranks
        need (attention ranks x the attention's ``--tensor-parallel-size``).

        Raises:
            LaunchError: the listed GPUs do not split evenly over the ranks.
        """
        attention = _device_list("--attention-devices", self.attention_devices)
        tp = tensor_parallel_size([*self.vllm_args, *self.attention_args])
        if not attention or len(attention) >= self.attention_ranks * tp:
            return 1
        sets = len(attention) // tp
        if len(attention) % tp or self.attention_ranks % sets:
            raise LaunchError(
                f"--attention-devices lists {len(attention)} GPUs for "
                f"{self.attention_ranks} attention ranks of {tp} GPU(s) each; to "
                "share GPUs, list a number of GPU sets (of the TP size) that "
                "divides the attention ranks"
            )
        return self.attention_ranks // sets

    def plain_devices(self) -> str | None:
        """``CUDA_VISIBLE_DEVICES`` of the plain baseline: every GPU the AFD
        roles were given, so both run on the same hardware, each once (a GPU
        both roles share, listed twice, would hide every GPU from CUDA)."""
        attention, ffns = self.role_devices()
        given = [d for role in (attention, *ffns) if role for d in role.split(",")]
        return ",".join(dict.fromkeys(given)) if given else None

    def shared_gpus(self) -> list[str]:
        attention = _device_list("--attention-devices", self.attention_devices)
        ffn = _device_list("--ffn-devices", self.ffn_devices)
        return [d for d in attention or () if d in (ffn or ())]

    def data_plane(self) -> str:
        """The p2p backend the CUDA roles will use: ``nccl`` or ``cuda_ipc``.
        ``auto`` is NCCL, except when the device lists give both roles a GPU
        on one host: then the launcher asks for cuda_ipc (NCCL cannot pair
        two ranks on one GPU). ``tcp`` for the async connector (its frames
        travel on TCP; its option ``payload`` says where their rows go)."""
        if self.connector == "async":
            return "tcp"
        backend = (self.connector_extra_config or {}).get("backend", "auto")
        if backend == "auto":
            one_host = not self.multi_host
            return "cuda_ipc" if one_host and self.shared_gpus() else "nccl"
        return backend

    def _connector_extra(self) -> dict:
        extra = dict(self.connector_extra_config or {})
        if extra.get("backend", "auto") == "auto" and self.data_plane() == "cuda_ipc":
            extra["backend"] = "cuda_ipc"
        return extra

    def afd_config(self, role: str) -> dict:
        split = role == "attention" and self.ubatches > 1
        per_device = self.attention_ranks_per_device() if role == "attention" else 1
        return {
            "role": role,
            "connector": self.connector,
            "host": self.placement().afd_host if self.multi_host else self.host,
            "port": self.afd_port,
            "num_attention_ranks": self.attention_ranks,
            "num_ffn_ranks": self.ffn_ranks,
            # the async connector routes on attention (its config implies it)
            "compute_gate_on_attention": self.gate_on_attention
            or self.connector == "async",
            "connector_extra_config": self._connector_extra(),
            **({"num_ubatches": self.ubatches} if split else {}),
            **({"attention_ranks_per_device": per_device} if per_device > 1 else {}),
        }


def _nodes(value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return tuple(int(x) for x in value.split(","))
    except ValueError:
        raise PlacementError(
            f"{value!r} is not a list of node ranks, e.g. 0,0,1"
        ) from None


def _device_list(flag: str, value: str | None) -> list[str] | None:
    if value is None:
        return None
    devices = [d.strip() for d in value.split(",")]
    if not all(devices):
        raise LaunchError(f"{flag}={value!r} has an empty entry; e.g. {flag} 0,1")
    return devices


def vllm_arg(args: Sequence[str], *names: str) -> str | None:
    """The value of option ``names`` in vLLM arguments (``--opt V`` or
    ``--opt=V``; "" when it has none), the last one given winning as in
    vLLM's parser; None when absent."""
    value = None
    for i, arg in enumerate(args):
        name, eq, given = arg.partition("=")
        if name in names:
            value = given if eq else (args[i + 1] if i + 1 < len(args) else "")
    return value


#: vLLM's option that configures a KV connector
KV_TRANSFER_FLAG = "--kv-transfer-config"


def without_option(args: Sequence[str], name: str) -> list[str]:
    """vLLM arguments ``args`` without option ``name`` (``--opt V`` and
    ``--opt=V``)."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg == name:
            skip = True
            continue
        if arg.startswith(name + "="):
            continue
        out.append(arg)
    return out


def ffn_kv_refusal() -> str:
    """The error for a KV connector given to the FFN role."""
    return (
        "the FFN role holds no KV cache, so it takes no KV connector "
        f"({KV_TRANSFER_FLAG}): give it to the attention role (and, with PD, "
        "to the prefill servers)"
    )


def tensor_parallel_size(args: Sequence[str]) -> int:
    """The ``--tensor-parallel-size`` / ``-tp`` in vLLM arguments (1 if none)."""
    try:
        return int(vllm_arg(args, "--tensor-parallel-size", "-tp") or 1)
    except ValueError:
        return 1


def visible_gpus() -> list[str]:
    """The GPUs a child process sees, without initialising CUDA here: none
    without ``nvidia-smi`` (a CPU host), else ``CUDA_VISIBLE_DEVICES`` when
    set, else every GPU ``nvidia-smi -L`` lists."""
    listed = nvidia_smi("-L")
    if listed is None:
        return []
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [d.strip() for d in given.split(",") if d.strip()]
    return [
        str(i) for i, line in enumerate(listed.splitlines()) if line.startswith("GPU")
    ]
