"""Data plane of the p2p connector: a private Gloo or NCCL process group.

Wraps ``torch.distributed.ProcessGroupGloo`` / ``ProcessGroupNCCL``, built
directly on a ``TCPStore`` (hosted by ffn rank 0 at ``afd.host:afd.port + 1``,
bound to that address only) under a
``PrefixStore`` named after the rendezvous session. The default process group
is never touched: vLLM owns it in the same process. FFN rank 0 hosts the store
once per process and address, for every session: when the deployment re-forms
after a failed step, the last session's group can still hold the old store
(pending receives, the error's frames), so a new one could not bind the port.

World: ``A + F`` members, FFN ranks first (``Topology.global_rank``). Each
exchange is a tagged ``send``/``recv``; Gloo matches on the tag, so a receive
never takes the bytes of another (step, layer, ubatch, kind). NCCL ignores
tags and relies on the plan order; its waits order streams and never block
the host, and its timeouts are the process group's (``timeout_s``).
"""

from __future__ import annotations

import datetime
import errno
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from vllm_afd.connector.control import Rendezvous
from vllm_afd.connector.data import Capabilities, DataPlane, Work
from vllm_afd.connector.p2p_wire import listen
from vllm_afd.errors import (
    AFDConfigError,
    AFDConnectorError,
    AFDPeerError,
    AFDTimeoutError,
)

#: (host, port) -> the store this process hosts there, kept for every session
_HOSTED: dict[tuple[str, int], dist.TCPStore] = {}


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _translate(e: RuntimeError) -> AFDTimeoutError | AFDPeerError:
    """Gloo's RuntimeError -> our taxonomy, without the source-file prefix."""
    text = str(e).split("] ", 1)[-1].split(". This is typically")[0]
    if "timed out" in text.lower():
        return AFDTimeoutError(text)
    return AFDPeerError(text)


_GLOO = Capabilities(graph_capturable=False, matches_tags=True, bounded_wait=True)
#: NCCL pairs by order and its device-side waits have no host timeout
_NCCL = Capabilities(graph_capturable=True, matches_tags=False, bounded_wait=False)


class _GlooWork(Work):
    __slots__ = ("_work",)

    def __init__(self, work: dist.Work) -> None:
        self._work = work

    def wait(self, timeout_s: float) -> None:
        try:
            self._work.wait(_td(timeout_s))
        except RuntimeError as e:
            raise _translate(e) from None


class _NcclWork(Work):
    __slots__ = ("_work",)

    def __init__(self, work: dist.Work) -> None:
        self._work = work

    def wait(self, timeout_s: float) -> None:
        # Stream-ordered: makes the current stream wait, no host sync.
        self._work.wait()


class P2PDataPlane(DataPlane):
    """Tagged point-to-point sends over a private process group."""

    def __init__(
        self,
        *,
        host: str,
        store_port: int,
        global_rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        connect_timeout_s: float,
        gpu: str = "",
    ) -> None:
        self._host, self._store_port = host, store_port
        self._gpu = gpu  # NCCL: this endpoint's GPU UUID (setup compares them)
        self._rank, self._world = global_rank, world_size
        self._backend = backend
        self._timeout_s, self._connect_timeout_s = timeout_s, connect_timeout_s
        self._store: dist.Store | None = None
        self._pg: dist.ProcessGroup | None = None
        self._work_cls = _NcclWork if backend == "nccl" else _GlooWork
        # NCCL: a receive posted early would block the stream ahead of the send.
        self.prepost_recv = backend != "nccl"
        self.backend = backend
        self.capabilities = _NCCL if backend == "nccl" else _GLOO

    def setup(self, peer: int, theirs: Mapping[str, Any] | None) -> dict[str, Any]:
        mine = super().setup(peer, theirs)
        if self.backend != "nccl":
            return mine
        if theirs is not None and self._gpu and theirs.get("gpu") == self._gpu:
            raise AFDConfigError(
                f"attention peer {peer} and this ffn rank are on one GPU "
                f"({self._gpu}): NCCL cannot pair two ranks on one GPU; set "
                "afd.connector_extra_config.backend='cuda_ipc' on both roles "
                "(with the MPS daemon running)"
            )
        return {**mine, "gpu": self._gpu}

    def prepare(self) -> None:
        if self._rank != 0:
            return
        key = (self._host, self._store_port)
        if key in _HOSTED:  # an earlier session's: sessions have own prefixes
            self._store = _HOSTED[key]
            return
        # Bind the store to afd.host only (TCPStore alone binds every
        # interface): hand it a socket listening there.
        sock = listen(self._host, self._store_port)
        try:
            self._store = _HOSTED[key] = dist.TCPStore(
                self._host, self._store_port, None, True,
                _td(self._connect_timeout_s), wait_for_workers=False,
                master_listen_fd=sock.detach(),
            )  # fmt: skip
        except (RuntimeError, OSError) as e:
            in_use = "in use" in str(e) or getattr(e, "errno", 0) == errno.EADDRINUSE
            cause = "address already in use" if in_use else str(e)
            raise AFDConnectorError(
                f"cannot host the data-plane store on {self._host}:"
                f"{self._store_port} (afd.port+1): {cause}. Stop the program that "
                "holds it or choose another afd.port"
            ) from None

    def start(self, rendezvous: Rendezvous) -> None:
        if self._store is None:
            try:
                self._store = dist.TCPStore(
                    self._host, self._store_port, None, False,
                    _td(self._connect_timeout_s), wait_for_workers=False,
                )  # fmt: skip
            except (RuntimeError, OSError) as e:
                raise AFDConnectorError(
                    f"cannot reach the data-plane store at {self._host}:"
                    f"{self._store_port} (afd.port+1): {e}"
                ) from None
        store = dist.PrefixStore(f"afd/{rendezvous.session}/", self._store)
        try:
            self._pg = self._make_group(store, rendezvous.local_host)
        except RuntimeError as e:
            raise AFDConnectorError(
                f"could not build the {self._backend} data-plane group "
                f"(connector rank {self._rank} of {self._world}, on "
                f"{rendezvous.local_host or 'every interface'}): {e}. Every "
                "endpoint must reach the others at the address it reaches ffn "
                "rank 0 from, on any port"
            ) from None

    def _make_group(self, store: dist.Store, local_host: str) -> dist.ProcessGroup:
        if self._backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = _td(self._timeout_s)
            return dist.ProcessGroupNCCL(store, self._rank, self._world, opts)
        gloo = dist.ProcessGroupGloo
        opts = gloo._Options()
        device = (
            gloo.create_device(hostname=local_host)
            if local_host
            else gloo.create_default_device()
        )
        opts._devices = [device]
        opts._timeout = _td(self._connect_timeout_s)
        return gloo(store, self._rank, self._world, opts)

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        pg = self._group()
        try:
            return self._work_cls(pg.send([tensor], peer, tag))
        except RuntimeError as e:
            raise _translate(e) from None

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        pg = self._group()
        try:
            return self._work_cls(pg.recv([tensor], peer, tag))
        except RuntimeError as e:
            raise _translate(e) from None

    def _group(self) -> dist.ProcessGroup:
        if self._pg is None:
            raise AFDConnectorError("the p2p data plane is not started or closed")
        return self._pg

    def close(self) -> None:
        # Dropping the group closes its connections: peers blocked on us see
        # "connection closed" at once instead of waiting for their timeout
        # (the connector drops what else holds it: see AFDConnector.close).
        # A hosted store stays (``_HOSTED``) for the next session.
        self._pg = None
        self._store = None
