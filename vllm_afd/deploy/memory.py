"""What vLLM may take of a host (CPU) or a GPU that several role processes share.

vLLM sizes every server as if it were alone: on CPU ``--gpu-memory-utilization``
(0.92 there) of the node's RAM must be free when a worker starts, on CUDA 0.9 of
the GPU. Two roles on one host would each ask for that, and the second fails
(``ValueError: Available memory on node 0 (20.93/23.54 GiB) on startup is less
than desired CPU memory utilization (0.92, 21.66 GiB)``). The launcher divides
instead, unless the user set a size:

* **CPU**: the FFN role holds no KV cache (it starts with a KV size of 0:
  ``compat/engine_config.py``). Each attention worker gets
  ``--kv-cache-memory-bytes`` = :data:`KV_SHARE` of what is left of the
  host's available RAM once every role process of this node has its
  :data:`CPU_PROCESS_BYTES` and the checkpoint's bytes, split over the
  attention workers, at most :data:`MAX_AUTO_KV_BYTES`.
* **CUDA**, roles sharing a GPU: each FFN rank gets the fraction its weights
  need plus :data:`GPU_FFN_ACTIVATION_BYTES` (at least
  :data:`MIN_GPU_FRACTION`); the attention ranks on that GPU share the rest of
  vLLM's 0.9.

A user's own ``--kv-cache-memory-bytes`` / ``--gpu-memory-utilization`` (or
``VLLM_CPU_KVCACHE_SPACE``) for a role wins. A budget that cannot fit raises
:class:`MemoryBudgetError` with the numbers, before anything starts.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_afd.deploy.process import LaunchError

GiB = 1 << 30
MiB = 1 << 20
#: RAM of one role process tree on CPU beside its weights and KV cache (API
#: server, engine core, worker; ~3 GB measured for a 5M-parameter model)
CPU_PROCESS_BYTES = 3 * GiB
#: the share of the RAM left that the attention workers' KV caches take
KV_SHARE = 0.8
#: the smallest KV cache per attention worker the launcher starts with
MIN_KV_BYTES = 256 * MiB
#: the largest KV cache per attention worker the launcher gives on its own:
#: vLLM's CPU worker zeroes it at start (~5 s per GiB on two cores), and a
#: CPU deployment is for trying AFD (1 GiB holds ~10K tokens of a
#: 30B-A3B-shaped Qwen3-MoE in bf16); set ``--kv-cache-memory-bytes`` for more
MAX_AUTO_KV_BYTES = 1 * GiB
#: vLLM's default --gpu-memory-utilization on CUDA
GPU_UTILIZATION = 0.9
#: GPU memory of an FFN rank beside its weights (activations, CUDA graphs)
GPU_FFN_ACTIVATION_BYTES = 2 * GiB
#: the smallest fraction of a GPU the launcher gives a role process
MIN_GPU_FRACTION = 0.05
#: the flags that size vLLM's memory: set by the user, they win
MEMORY_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")


class MemoryBudgetError(LaunchError):
    """The role processes of this node cannot share its memory as asked."""


@dataclass(frozen=True)
class MemoryBudget:
    """vLLM arguments the launcher adds to each role of this node (empty: the
    role keeps vLLM's default or the user's setting), and one line saying why."""

    attention_args: tuple[str, ...] = ()
    ffn_args: tuple[str, ...] = ()
    note: str = ""


def sets_memory(args: Sequence[str]) -> bool:
    """Whether vLLM arguments ``args`` size the memory themselves."""
    return any(arg.partition("=")[0] in MEMORY_FLAGS for arg in args)


def checkpoint_bytes(model: str) -> int:
    """Bytes of the weight files of a local checkpoint directory; for a
    directory with a ``config.json`` and no weight files (served with
    ``--load-format dummy``), the bytes its config describes
    (:func:`config_weight_bytes`); 0 when ``model`` is no local directory (a
    hub name)."""
    root = Path(model)
    if not root.is_dir():
        return 0
    files = [*root.glob("*.safetensors"), *root.glob("*.bin"), *root.glob("*.pt")]
    if not files and (root / "config.json").is_file():
        return config_weight_bytes(root)
    return sum(f.stat().st_size for f in files)


def config_weight_bytes(root: Path) -> int:
    """The weight bytes a checkpoint's ``config.json`` describes: the model
    transformers builds from it on the meta device (no memory), its
    parameters times the config's dtype (bf16 when it names none). 0 when
    transformers cannot build it (an architecture it does not know)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(root)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, OSError, ImportError, TypeError):
        return 0
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else 2
    return sum(p.numel() for p in model.parameters()) * itemsize


def _numa_node_of_first_cpu() -> int:
    """The NUMA node of this process's first allowed CPU (where vLLM's CPU
    worker looks for memory); 0 when the system does not say."""
    try:
        cpu = min(os.sched_getaffinity(0))
        for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
            if (node / f"cpu{cpu}").exists():
                return int(node.name[4:])
    except (OSError, ValueError, AttributeError):
        pass
    return 0


def _cgroup_left() -> int | None:
    """Bytes the cgroup (v2) of this process may still take; None unlimited."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        usage = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else int(limit) - usage


def available_ram(node: int | None = None) -> int:
    """The RAM a CPU worker may take, counted as vLLM 0.32's CPU worker counts
    it (``vllm/utils/cpu_resource_utils.py``): free, file cache and
    reclaimable slab of its NUMA node (``MemAvailable`` without NUMA
    information), within the cgroup's limit.

    Raises:
        MemoryBudgetError: neither file can be read.
    """
    node = _numa_node_of_first_cpu() if node is None else node
    path = Path(f"/sys/devices/system/node/node{node}/meminfo")
    try:
        if path.is_file():
            info = {}
            for line in path.read_text().splitlines():
                parts = line.split()  # "Node 0 MemFree: 13475684 kB"
                info[parts[2].rstrip(":")] = int(parts[3]) * 1024
            free = (
                info["MemFree"] + info["Active(file)"] + info["Inactive(file)"]
                + info["SReclaimable"]
            )  # fmt: skip
        else:
            lines = Path("/proc/meminfo").read_text().splitlines()
            [line] = [x for x in lines if x.startswith("MemAvailable:")]
            free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError, KeyError) as e:
        raise MemoryBudgetError(f"cannot read this host's free memory: {e}") from e
    left = _cgroup_left()
    return free if left is None else min(free, left)


def nvidia_smi(*args: str) -> str | None:
    """``nvidia-smi ARGS``'s output; None without ``nvidia-smi`` (a CPU host)
    or when it fails. Nothing here initialises CUDA."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        return subprocess.run(
            ["nvidia-smi", *args], capture_output=True, text=True, timeout=20,
            check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_total_bytes(device: str) -> int | None:
    """Memory of GPU ``device`` (an index or UUID) from ``nvidia-smi``; None
    when it cannot tell."""
    out = nvidia_smi(
        "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", device
    )
    try:
        return None if out is None else int(out.split()[0]) * MiB
    except (ValueError, IndexError):
        return None


def cpu_budget(
    *,
    attention_workers: int,
    ffn_workers: int,
    weight_bytes: int,
    available: int,
) -> MemoryBudget:
    """The KV cache of each attention worker of a CPU host.

    Args:
        attention_workers: attention workers on this host (ranks x TP).
        ffn_workers: FFN workers on this host (ranks x TP).
        weight_bytes: the checkpoint's weight bytes (each role process is
            counted as holding all of them: an upper bound).
        available: the host's available RAM.

    Raises:
        MemoryBudgetError: less than :data:`MIN_KV_BYTES` per attention worker.
    """
    if attention_workers == 0:
        return MemoryBudget()
    servers = 1 + ffn_workers  # this host's attention server and FFN workers
    reserved = CPU_PROCESS_BYTES * (attention_workers + ffn_workers)
    reserved += weight_bytes * servers
    left = available - reserved
    per_worker = int(left * KV_SHARE / attention_workers) // MiB * MiB
    share = per_worker
    per_worker = min(per_worker, MAX_AUTO_KV_BYTES)
    workers = attention_workers + ffn_workers
    numbers = (
        f"{available / GiB:.1f} GiB of RAM available; {workers} role worker(s) "
        f"need ~{reserved / GiB:.1f} GiB beside the KV cache "
        f"({CPU_PROCESS_BYTES / GiB:.0f} GiB each and {weight_bytes / GiB:.2f} "
        "GiB of weights per role process)"
    )
    if share < MIN_KV_BYTES:
        raise MemoryBudgetError(
            f"this host cannot hold the role processes asked for: {numbers}, "
            f"which leaves {max(share, 0) / MiB:.0f} MiB of KV cache per "
            f"attention worker (at least {MIN_KV_BYTES / MiB:.0f} MiB); run fewer "
            "ranks on this host, or give the attention role a KV cache size "
            "yourself (--attention-args '--kv-cache-memory-bytes 1G')"
        )
    return MemoryBudget(
        attention_args=("--kv-cache-memory-bytes", str(per_worker)),
        note=f"memory: {numbers}: KV cache {per_worker / GiB:.2f} GiB per "
        "attention worker (--kv-cache-memory-bytes; set it to choose)",
    )


def gpu_budget(
    *,
    ffn_per_gpu: int,
    attention_per_gpu: int,
    weight_bytes: int,
    total: int | None,
    attention_set: bool,
    ffn_set: bool,
) -> MemoryBudget:
    """``--gpu-memory-utilization`` of the roles sharing one GPU.

    Args:
        ffn_per_gpu: FFN ranks on the shared GPU.
        attention_per_gpu: attention ranks on the shared GPU.
        weight_bytes: the checkpoint's weight bytes (an FFN rank is counted
            as holding all of them: an upper bound).
        total: the GPU's memory (None: unknown; FFN ranks then get
            :data:`MIN_GPU_FRACTION` x 2).
        attention_set, ffn_set: the user sized that role's memory (it keeps
            its setting, and the other role is sized around vLLM's default).

    Raises:
        MemoryBudgetError: the FFN ranks' weights leave the attention ranks
            less than :data:`MIN_GPU_FRACTION` each.
    """
    if total:
        need = (weight_bytes + GPU_FFN_ACTIVATION_BYTES) / total
        ffn = max(math.ceil(need * 100) / 100, MIN_GPU_FRACTION)
    else:
        ffn = 2 * MIN_GPU_FRACTION
    ffn_total = ffn * ffn_per_gpu if ffn_per_gpu else 0.0
    per_rank = (GPU_UTILIZATION - ffn_total) / max(attention_per_gpu, 1)
    per_rank = math.floor(per_rank * 100) / 100
    if attention_per_gpu and per_rank < MIN_GPU_FRACTION and not attention_set:
        raise MemoryBudgetError(
            f"one GPU cannot hold {ffn_per_gpu} FFN rank(s) of "
            f"{weight_bytes / GiB:.1f} GiB of weights (each "
            f"--gpu-memory-utilization {ffn:.2f}) and {attention_per_gpu} "
            f"attention rank(s): {max(per_rank, 0):.2f} of the GPU is left for "
            "each attention rank; put the roles on separate GPUs "
            "(--attention-devices / --ffn-devices) or size them yourself"
        )
    att_args: tuple[str, ...] = ()
    if attention_per_gpu and not attention_set:
        att_args = ("--gpu-memory-utilization", f"{per_rank:.2f}")
    ffn_args: tuple[str, ...] = ()
    if ffn_per_gpu and not ffn_set:
        ffn_args = ("--gpu-memory-utilization", f"{ffn:.2f}")
    given = [
        f"{name} {args[1]}"
        for name, args in (
            ("each attention rank", att_args),
            ("each FFN rank", ffn_args),
        )
        if args
    ]
    note = f"memory: roles share a GPU: --gpu-memory-utilization {', '.join(given)}"
    return MemoryBudget(att_args, ffn_args, note if given else "")


def user_env_sets_cpu_kv(env: Mapping[str, str] = os.environ) -> bool:
    """``VLLM_CPU_KVCACHE_SPACE`` (vLLM's legacy CPU KV size) is set."""
    return bool(env.get("VLLM_CPU_KVCACHE_SPACE"))
