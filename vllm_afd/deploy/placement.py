"""Where each role rank runs when a deployment spans several hosts.

The same ``vllm-afd launch`` command runs on every host (node), each with its
place: ``--hosts`` names every node's address (node rank = position),
``--node-rank`` this one (or the environment of Kubernetes LeaderWorkerSet,
``LWS_WORKER_INDEX``, or Slurm, ``SLURM_NODEID``). ``--attention-nodes`` and
``--ffn-nodes`` put each rank on a node. From that, each launcher derives the
processes of its node and their flags:

* FFN rank k: one ``vllm serve`` on ``ffn_nodes[k]``, the connector at
  ``afd.host`` = the address of FFN rank 0's node;
* the attention ranks: vLLM's own multi-node data parallelism, one ``vllm
  serve`` per node that holds attention ranks (they must be consecutive per
  node, as vLLM numbers them): the node of rank 0 answers the API
  (``--data-parallel-size-local``, ``--data-parallel-address``,
  ``--data-parallel-rpc-port``), the others run ``--headless`` with their
  ``--data-parallel-start-rank``;
* every process of a node: ``VLLM_HOST_IP`` = the node's address, and
  ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` = the interface that holds
  it (vLLM's own process groups advertise loopback without them).

Imports neither vLLM nor torch.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: environment variables that give a node its rank, in the order tried
NODE_RANK_VARIABLES = ("LWS_WORKER_INDEX", "SLURM_NODEID")


class PlacementError(ValueError):
    """The hosts, node rank or rank placement do not describe a deployment."""


@dataclass(frozen=True)
class Placement:
    """Node of every role rank; ``hosts[n]`` is node n's address."""

    hosts: tuple[str, ...]
    attention_nodes: tuple[int, ...]
    ffn_nodes: tuple[int, ...]

    @classmethod
    def single(cls, attention_ranks: int, ffn_ranks: int) -> Placement:
        """Everything on one host (the launcher's own)."""
        return cls(("127.0.0.1",), (0,) * attention_ranks, (0,) * ffn_ranks)

    @classmethod
    def make(
        cls,
        hosts: Sequence[str],
        attention_ranks: int,
        ffn_ranks: int,
        attention_nodes: Sequence[int] | None = None,
        ffn_nodes: Sequence[int] | None = None,
    ) -> Placement:
        """Validate a placement; defaults: every attention rank on node 0,
        the FFN ranks spread over the other nodes in turn (node 0 too when
        there is no other).

        Raises:
            PlacementError: a list of the wrong length, a node outside
                ``hosts``, attention ranks not consecutive per node, or a
                node with nothing to run.
        """
        hosts = tuple(h.strip() for h in hosts)
        n = len(hosts)
        if not n or not all(hosts):
            raise PlacementError(f"--hosts {','.join(hosts)!r} has an empty entry")
        if len(set(hosts)) != n:
            raise PlacementError(f"--hosts lists a host twice: {','.join(hosts)}")
        if attention_nodes is None:
            attention_nodes = [0] * attention_ranks
        if ffn_nodes is None:
            others = list(range(1, n)) or [0]
            ffn_nodes = [others[k % len(others)] for k in range(ffn_ranks)]
        for flag, nodes, want in (
            ("--attention-nodes", attention_nodes, attention_ranks),
            ("--ffn-nodes", ffn_nodes, ffn_ranks),
        ):
            if len(nodes) != want:
                raise PlacementError(
                    f"{flag} lists {len(nodes)} nodes for {want} ranks; give one "
                    "node rank per rank, e.g. " + flag + " " + ",".join(["0"] * want)
                )
            bad = [x for x in nodes if not 0 <= x < n]
            if bad:
                raise PlacementError(
                    f"{flag} names node {bad[0]}, but --hosts lists nodes 0..{n - 1}"
                )
        if list(attention_nodes) != sorted(attention_nodes):
            raise PlacementError(
                f"--attention-nodes {','.join(map(str, attention_nodes))}: attention "
                "ranks must be consecutive per node (vLLM numbers the data-parallel "
                "ranks of a node from its start rank), e.g. 0,0,1,1"
            )
        idle = [x for x in range(n) if x not in (*attention_nodes, *ffn_nodes)]
        if idle:
            raise PlacementError(
                f"node {idle[0]} ({hosts[idle[0]]}) runs no rank; drop it from "
                "--hosts or place a rank there"
            )
        return cls(hosts, tuple(attention_nodes), tuple(ffn_nodes))

    @property
    def num_nodes(self) -> int:
        return len(self.hosts)

    @property
    def afd_host(self) -> str:
        """``afd.host``: the address of FFN rank 0's node."""
        return self.hosts[self.ffn_nodes[0]]

    @property
    def attention_leader(self) -> int:
        """The node of attention rank 0 (the one with the API server)."""
        return self.attention_nodes[0]

    @property
    def attention_spans_nodes(self) -> bool:
        return len(set(self.attention_nodes)) > 1

    def ffn_ranks_on(self, node: int) -> list[int]:
        return [k for k, x in enumerate(self.ffn_nodes) if x == node]

    def attention_ranks_on(self, node: int) -> list[int]:
        """The attention ranks of ``node`` (consecutive)."""
        return [a for a, x in enumerate(self.attention_nodes) if x == node]

    def attention_flags(self, node: int, rpc_port: int) -> list[str]:
        """vLLM data-parallel flags of the attention server on ``node``
        (empty when no attention rank runs there)."""
        ranks = self.attention_ranks_on(node)
        total = len(self.attention_nodes)
        if not ranks:
            return []
        if not self.attention_spans_nodes:
            return ["--data-parallel-size", str(total)] if total > 1 else []
        flags = [
            "--data-parallel-size", str(total),
            "--data-parallel-size-local", str(len(ranks)),
            "--data-parallel-address", self.hosts[self.attention_leader],
            "--data-parallel-rpc-port", str(rpc_port),
        ]  # fmt: skip
        if node != self.attention_leader:
            flags += ["--headless", "--data-parallel-start-rank", str(ranks[0])]
        return flags

    def describe(self) -> str:
        """One line per node: its address and ranks."""
        lines = []
        for node, host in enumerate(self.hosts):
            what = []
            att = self.attention_ranks_on(node)
            if att:
                api = " (API)" if node == self.attention_leader else " (headless)"
                what.append(f"attention {_span(att)}{api}")
            ffn = self.ffn_ranks_on(node)
            if ffn:
                what.append(f"ffn {_span(ffn)}")
            lines.append(f"node {node} {host}: {', '.join(what)}")
        return "\n".join(lines)


def _span(ranks: list[int]) -> str:
    """``rank 0`` or ``ranks 0,1``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ",".join(map(str, ranks))


def node_rank_from(given: int | None, env: Mapping[str, str], num_nodes: int) -> int:
    """This launcher's node rank: ``--node-rank``, else the first of
    :data:`NODE_RANK_VARIABLES` set, else 0 on one node.

    Raises:
        PlacementError: several nodes and no rank, or a rank outside them.
    """
    source, rank = "--node-rank", given
    if rank is None:
        for name in NODE_RANK_VARIABLES:
            value = env.get(name)
            if value is not None and value.strip().isdigit():
                source, rank = name, int(value)
                break
    if rank is None:
        if num_nodes == 1:
            return 0
        raise PlacementError(
            f"--hosts lists {num_nodes} nodes: give this one's --node-rank (or run "
            f"where {' or '.join(NODE_RANK_VARIABLES)} is set)"
        )
    if not 0 <= rank < num_nodes:
        raise PlacementError(
            f"{source}={rank}, but --hosts lists nodes 0..{num_nodes - 1}"
        )
    return rank


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds ``address``
    (a name is resolved first), or None when no interface holds it."""
    try:
        import psutil
    except ImportError:  # vLLM depends on psutil; without it: unknown
        return None
    try:
        ip = socket.gethostbyname(address)
    except OSError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            return name
    return None


def node_env(address: str, *, check_local: bool = True) -> dict[str, str]:
    """The variables every process of the node at ``address`` needs.

    Raises:
        PlacementError: ``check_local`` and ``address`` is not this host's.
    """
    try:
        ip = socket.gethostbyname(address)
    except OSError:
        ip = address
    env = {"VLLM_HOST_IP": ip}
    iface = interface_of(ip)  # resolved once: a name may take a DNS round trip
    if iface is None:
        if check_local:
            raise PlacementError(
                f"{address} (this node's entry in --hosts) is not an address of "
                "this host; check --hosts and --node-rank"
            )
        iface = f"<interface of {address}>"
    env["GLOO_SOCKET_IFNAME"] = iface
    env["NCCL_SOCKET_IFNAME"] = iface
    return env
