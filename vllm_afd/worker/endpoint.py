"""Connector set-up shared by the AFD model runners of both roles.

Called by the runners' ``load_model`` once the role-split model is built: it
works out this process's endpoint rank from vLLM's DP/TP ranks, builds the
handshake fingerprint from the model, creates the connector through the
factory and starts it (rendezvous + handshake, bounded by
``connect_timeout_s``), then logs one INFO summary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.logger import init_logger

from vllm_afd.compat import independent_ranks
from vllm_afd.config import AFDConfig
from vllm_afd.connector import factory
from vllm_afd.connector.async_ep import AsyncEndpoint
from vllm_afd.connector.connector import AFDConnector
from vllm_afd.connector.protocol import PROTOCOL_VERSION, Fingerprint
from vllm_afd.models.layout import ModelSplit
from vllm_afd.topology import Topology, endpoint_rank
from vllm_afd.worker.identity import model_digest

logger = init_logger(__name__)


@dataclass
class Endpoint:
    """This worker's AFD context, built once: its config, the model's split,
    its place in the deployment, the handshake fingerprint and its connector
    (None on attention TP ranks other than 0): ``connector`` for the
    synchronous exchange, ``work`` for the ``async`` one."""

    afd: AFDConfig
    split: ModelSplit
    topology: Topology
    role_rank: int
    tp_rank: int
    fingerprint: Fingerprint
    connector: AFDConnector | None
    #: what sized the connector's buffers (a rejoin builds the same)
    limits: factory.ExchangeLimits = factory.ExchangeLimits()
    work: AsyncEndpoint | None = None

    def close(self, reason: str | None = None) -> None:
        if self.connector is not None:
            self.connector.close(reason)
        if self.work is not None:
            self.work.close(reason)


def fingerprint_of(
    vllm_config: VllmConfig, afd: AFDConfig, split: ModelSplit
) -> Fingerprint:
    """What both roles must agree on before any tensor crosses: the model each
    role loaded, its split as the role built it, and the deployment."""
    return Fingerprint(
        arch=split.arch,
        hidden_size=split.hidden_size,
        dtype=str(vllm_config.model_config.dtype).removeprefix("torch."),
        num_layers=split.num_layers,
        moe_layers=split.moe_layers,
        num_experts=split.num_experts,
        top_k=split.top_k,
        num_attention_ranks=afd.num_attention_ranks,
        num_ffn_ranks=afd.num_ffn_ranks,
        compute_gate_on_attention=afd.compute_gate_on_attention,
        connector=afd.connector,
        moe_output_parts=split.moe_output_parts,
        remote_layers=split.remote_layers,
        model_digest=model_digest(vllm_config),
    )


def open_endpoint(
    vllm_config: VllmConfig, afd: AFDConfig, split: ModelSplit, device: torch.device
) -> Endpoint:
    """Create and start this process's connector (TP rank 0 only)."""
    parallel = vllm_config.parallel_config
    topology = afd.topology
    tp_rank = get_tensor_model_parallel_rank()
    dp_rank, dp_size = independent_ranks.data_parallel_place(parallel, afd)
    role_rank = endpoint_rank(
        topology, afd.role, dp_rank=dp_rank, dp_size=dp_size, tp_rank=tp_rank,
        ffn_rank=afd.rank,
    )  # fmt: skip
    fingerprint = fingerprint_of(vllm_config, afd, split)
    limits = factory.ExchangeLimits(
        max_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        ubatches=afd.num_ubatches,
    )
    connector = None
    work = None
    if role_rank is not None and afd.is_async:
        work = factory.create_async_endpoint(
            afd, role_rank, fingerprint, limits, device
        )
        work.start()
    elif role_rank is not None:
        connector = factory.create_connector(
            afd, role_rank, fingerprint, device, limits
        )
        connector.start()
    rank = role_rank
    if rank is None:
        rank = (afd.rank or 0) if afd.is_ffn else dp_rank
    peers = topology.peers(afd.role, rank)
    logger.info(
        "AFD %s rank %d/%d (tp rank %d%s): topology %s, peers %s rank(s) %s, "
        "connector %s at %s:%d, protocol v%d, fingerprint %s",
        afd.role.value,
        rank,
        topology.num_ranks(afd.role),
        tp_rank,
        "" if connector or work else ", follows tp rank 0",
        topology.name,
        "ffn" if afd.is_attention else "attention",
        list(peers),
        afd.connector,
        afd.host,
        afd.port,
        PROTOCOL_VERSION,
        fingerprint.digest,
    )
    return Endpoint(
        afd, split, topology, rank, tp_rank, fingerprint, connector, limits, work
    )
