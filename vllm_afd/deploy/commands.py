"""Command lines and environments of every role process of a deployment,
and ``--dry-run``'s rendering of them.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Sequence

from vllm_afd.deploy import placement
from vllm_afd.deploy.memory import (
    MemoryBudget,
    available_ram,
    checkpoint_bytes,
    cpu_budget,
    gpu_budget,
    gpu_total_bytes,
    sets_memory,
    user_env_sets_cpu_kv,
)
from vllm_afd.deploy.process import LaunchError, RoleProcess
from vllm_afd.deploy.spec import (
    KV_TRANSFER_FLAG,
    DeploymentSpec,
    ffn_kv_refusal,
    tensor_parallel_size,
    vllm_arg,
    without_option,
)

#: CPU work-around for vLLM 0.32.0's rotary kernel on DeepSeek (see docs).
CPU_COMPILATION_CONFIG = '{"custom_ops":["all","-rotary_embedding"]}'


def on_cpu(spec: DeploymentSpec) -> bool:
    """Whether the roles run on CPU (``spec.cpu_workaround`` when set, else
    no CUDA device visible to this process)."""
    if spec.cpu_workaround is not None:
        return spec.cpu_workaround
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True


def memory_budget(
    spec: DeploymentSpec,
    node: int | None = None,
    extra_kv_workers: int = 0,
    extra_ffn_workers: int = 0,
) -> MemoryBudget:
    """How the role processes of ``node`` share its memory
    (:mod:`vllm_afd.deploy.memory`): a CPU host's RAM, or a GPU that roles
    or attention ranks share. ``extra_kv_workers``: other KV-cache holders
    of this CPU host, or of the GPU both roles share, that take an attention
    worker's share (the prefill servers of a PD deployment);
    ``extra_ffn_workers``: other FFN workers there (an AFD prefill
    deployment's).

    Raises:
        MemoryBudgetError: they cannot share it; the message has the numbers.
    """
    node = spec.node_rank if node is None else node
    place = spec.placement()
    att_args = [*spec.vllm_args, *spec.attention_args]
    ffn_args = [*spec.vllm_args, *spec.ffn_args]
    attention = len(place.attention_ranks_on(node))
    if on_cpu(spec):
        if not attention or sets_memory(att_args) or user_env_sets_cpu_kv():
            return MemoryBudget()
        ffn = len(place.ffn_ranks_on(node)) * tensor_parallel_size(ffn_args)
        ffn += extra_ffn_workers
        return cpu_budget(
            attention_workers=attention * tensor_parallel_size(att_args)
            + extra_kv_workers,
            ffn_workers=ffn,
            weight_bytes=checkpoint_bytes(spec.model),
            available=available_ram(),
        )
    per_device = spec.attention_ranks_per_device()
    shared = spec.shared_gpus()
    if not shared:
        extra_kv_workers = extra_ffn_workers = 0  # they are not on a shared GPU
    if not shared and per_device == 1:
        return MemoryBudget()
    _, ffn_devices = spec.role_devices()
    ffn_here = [
        k for k in place.ffn_ranks_on(node)
        if shared and shared[0] in (ffn_devices[k] or "").split(",")
    ]  # fmt: skip
    return gpu_budget(
        ffn_per_gpu=len(ffn_here) + extra_ffn_workers,
        attention_per_gpu=(per_device if attention else 0) + extra_kv_workers,
        weight_bytes=checkpoint_bytes(spec.model),
        total=gpu_total_bytes(shared[0]) if shared and ffn_here else None,
        attention_set=sets_memory(att_args),
        ffn_set=sets_memory(ffn_args),
    )


def wants_cpu_workaround(spec: DeploymentSpec) -> bool:
    if any(a.startswith("--compilation-config") or a == "-cc" for a in spec.vllm_args):
        return False
    return on_cpu(spec)


def serve_argv(
    model: str, port: int, extra: Sequence[str], host: str = "127.0.0.1"
) -> list[str]:
    """argv of one ``vllm-afd serve`` process, its API bound to ``host``."""
    return [
        sys.executable,
        "-m",
        "vllm_afd.cli.main",
        "serve",
        model,
        "--host",
        host,
        "--port",
        str(port),
        *extra,
    ]


def api_host_of(spec: DeploymentSpec, role_args: Sequence[str], node: int = 0) -> str:
    """The API bind address of a role: a ``--host`` among its vLLM arguments
    (they come last on its command line, so vLLM takes it), else the spec's."""
    given = vllm_arg([*role_args, *spec.vllm_args], "--host")
    return given if given is not None else spec.node_api_host(node)


#: OpenMP's wait policy, which :func:`child_env` sets for CPU servers
OMP_WAIT_ENV = "OMP_WAIT_POLICY"


def child_env(devices: str | None, cpu: bool = False) -> dict[str, str]:
    """A server process's own environment: this one's, without the parent
    server's pid, with this launcher's pid (``AFD_LAUNCHER_PID``: the role
    stops when the launcher is gone, see ``vllm_afd.lifeline``) and
    ``CUDA_VISIBLE_DEVICES`` set when ``devices`` is.

    ``cpu``: a server on CPU, beside others on the same cores (vLLM's
    automatic binding puts every role's threads there): its idle OpenMP
    threads sleep (``OMP_WAIT_POLICY=PASSIVE``) instead of spinning, as GNU
    OpenMP's default does for a while, on the cores another role's step
    needs, unless this environment sets the policy."""
    env = dict(os.environ)
    env.pop("AFD_SERVER_PID", None)
    env["AFD_LAUNCHER_PID"] = str(os.getpid())
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    if cpu and OMP_WAIT_ENV not in env:
        env[OMP_WAIT_ENV] = "PASSIVE"
    return env


#: ``--cpu-bind split``
SPLIT = "split"
CPU_BIND_CHOICES = ("vllm", SPLIT)
#: vLLM's thread binding of a CPU worker (``auto``: its own choice)
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def core_shares(workers: int, cores: Sequence[int]) -> list[str]:
    """Each of ``workers`` an equal, consecutive share of ``cores``, as
    ``VLLM_CPU_OMP_THREADS_BIND`` lists them (``0,1``).

    Raises:
        ValueError: fewer cores than workers.
    """
    share = len(cores) // workers if workers > 0 else 0
    if share < 1:
        raise ValueError(
            f"{workers} CPU workers need {workers} cores, {len(cores)} here"
        )
    return [
        ",".join(str(c) for c in cores[i * share : (i + 1) * share])
        for i in range(workers)
    ]


def split_cores(
    spec: DeploymentSpec,
    procs: list[RoleProcess],
    attention_ranks: int,
    cores: Sequence[int] | None = None,
) -> None:
    """``--cpu-bind split``: give each role process of one node consecutive
    cores of its own (of ``cores``, default the launcher's CPU affinity), in
    equal shares: an FFN rank one share, the attention server one per
    attention rank it runs (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``, ranks
    apart by ``|``). The last process is the attention server when
    ``attention_ranks`` > 0.

    Raises:
        LaunchError: a CUDA deployment, ``VLLM_CPU_OMP_THREADS_BIND`` set
            already, or fewer cores than role processes need.
    """
    if not on_cpu(spec):
        raise LaunchError(
            "--cpu-bind split places CPU role processes; this deployment runs "
            "on CUDA devices (use --attention-devices / --ffn-devices)"
        )
    if os.environ.get(BIND_ENV, "auto") != "auto":
        raise LaunchError(
            f"{BIND_ENV}={os.environ[BIND_ENV]} is set, and --cpu-bind split "
            "sets it for each role process: unset one of them"
        )
    cores = sorted(os.sched_getaffinity(0)) if cores is None else list(cores)
    ffn = len(procs) - (1 if attention_ranks else 0)
    workers = ffn + attention_ranks
    try:
        shares = core_shares(workers, cores)
    except ValueError:
        raise LaunchError(
            f"--cpu-bind split gives each role process cores of its own: "
            f"{attention_ranks} attention rank(s) and {ffn} FFN rank(s) here need "
            f"{workers} cores, and the launcher may use {len(cores)}"
        ) from None
    for i, proc in enumerate(procs[:ffn]):
        proc.env[BIND_ENV] = shares[i]
    if attention_ranks:
        procs[-1].env[BIND_ENV] = "|".join(shares[ffn:])


def role_processes(
    spec: DeploymentSpec,
    node: int | None = None,
    *,
    check_local: bool = True,
    budget: MemoryBudget | None = None,
) -> list[RoleProcess]:
    """The processes of ``spec`` on ``node`` (default: the spec's node
    rank): FFN ranks first (FFN 0 hosts the rendezvous).

    One ``vllm serve`` per FFN rank (``afd.rank``; ports ``ffn_port + k``) and
    one for the attention role, with ``--data-parallel-size M`` when M > 1;
    across hosts, one attention server per node that holds attention ranks
    (``Placement.attention_flags``), and every process gets its node's
    address and interface (``placement.node_env``; ``check_local``: that
    address must be this host's). Each role gets its share of the node's
    memory (``budget``, default :func:`memory_budget`).

    Raises:
        PlacementError: the placement is not valid, or (``check_local``)
            this node's address is not this host's.
        MemoryBudgetError: the node's memory cannot hold its roles.
    """
    node = spec.node_rank if node is None else node
    place = spec.placement()
    budget = memory_budget(spec, node) if budget is None else budget
    node_vars = (
        placement.node_env(place.hosts[node], check_local=check_local)
        if spec.multi_host
        else {}
    )
    if vllm_arg(spec.ffn_args, KV_TRANSFER_FLAG) is not None:
        raise LaunchError(ffn_kv_refusal())
    common = list(spec.vllm_args)
    if wants_cpu_workaround(spec):
        common += ["--compilation-config", CPU_COMPILATION_CONFIG]
    # a KV connector among the common arguments is the attention role's
    ffn_common = without_option(common, KV_TRANSFER_FLAG)
    ffn_port = spec.ffn_port or spec.port + 1
    attention_devices, ffn_devices = spec.role_devices()
    cpu = on_cpu(spec)
    procs = []
    for k in place.ffn_ranks_on(node):
        afd = spec.afd_config("ffn")
        if spec.ffn_ranks > 1:
            afd["rank"] = k
        extra = ["--additional-config", json.dumps({"afd": afd})]
        name = "ffn" if spec.ffn_ranks == 1 else f"ffn{k}"
        host = api_host_of(spec, spec.ffn_args, node)
        extra += budget.ffn_args
        argv = serve_argv(
            spec.model, ffn_port + k, extra + spec.ffn_args + ffn_common, host
        )
        env = {**child_env(ffn_devices[k], cpu), **node_vars}
        procs.append(RoleProcess(name, argv, ffn_port + k, env, host))
    attention_ranks = len(place.attention_ranks_on(node))
    if attention_ranks:
        afd = spec.afd_config("attention")
        extra = ["--additional-config", json.dumps({"afd": afd})]
        extra += place.attention_flags(node, spec.dp_rpc_port or spec.afd_port + 2)
        extra += budget.attention_args
        host = api_host_of(spec, spec.attention_args, node)
        argv = serve_argv(
            spec.model, spec.port, extra + spec.attention_args + common, host
        )
        env = {**child_env(attention_devices, cpu), **node_vars}
        headless = node != place.attention_leader
        procs.append(
            RoleProcess("attention", argv, spec.port, env, host, headless=headless)
        )
    if spec.cpu_bind == SPLIT:
        split_cores(spec, procs, attention_ranks)
    return procs


SHOWN_VARIABLES = (
    "CUDA_VISIBLE_DEVICES", "VLLM_HOST_IP", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
    BIND_ENV, OMP_WAIT_ENV,
)  # fmt: skip


def dry_run(
    spec: DeploymentSpec,
    only: int | None = None,
    budget: MemoryBudget | None = None,
    group: str = "",
) -> str:
    """Every node's processes as shell lines (``only``: that node's): the
    variables a process gets beyond the launcher's environment, then its
    ``vllm-afd serve`` command. Interfaces of other hosts than this one show
    as ``<interface of ADDRESS>``. ``budget``: the memory shares (default
    :func:`memory_budget` of each node); ``group``: before each role's name
    (``prefill-``)."""
    place = spec.placement()
    out = [f"# AFD {spec.attention_ranks}A{spec.ffn_ranks}F on {place.num_nodes} "]
    out[0] += "node" if place.num_nodes == 1 else "nodes"
    out += [f"# {line}" for line in place.describe().splitlines()]
    for node in range(place.num_nodes):
        if only is not None and node != only:
            continue
        out.append(f"## node {node} ({place.hosts[node]})")
        for proc in role_processes(spec, node, check_local=False, budget=budget):
            shown = [
                f"{k}={shlex.quote(proc.env[k])}"
                for k in SHOWN_VARIABLES
                if k in proc.env and proc.env[k] != os.environ.get(k)
            ]
            argv = ["vllm-afd", *proc.argv[3:]]  # [python, -m, module, serve, ...]
            headless = " (headless)" if proc.headless else ""
            out.append(f"# {group}{proc.name}{headless}")
            out.append(" ".join([*shown, shlex.join(argv)]))
    return "\n".join(out)
