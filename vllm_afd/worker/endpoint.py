"""Connector set-up shared by the AFD model runners of both roles.

Called by the runners' ``load_model`` once the role-split model is built: it
works out this process's endpoint rank from vLLM's DP/TP ranks, builds the
handshake fingerprint from the model, creates the connector through the
factory and starts it (rendezvous + handshake, bounded by
``connect_timeout_s``), then logs one INFO summary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.logger import init_logger

from vllm_afd.config import AFDConfig
from vllm_afd.connector import factory
from vllm_afd.connector.protocol import PROTOCOL_VERSION, Fingerprint
from vllm_afd.models.moe_tail import moe_output_parts
from vllm_afd.models.ownership import LayerLayout
from vllm_afd.topology import Topology, endpoint_rank

logger = init_logger(__name__)


@dataclass
class Endpoint:
    """This process's place in the deployment and its connector (if any)."""

    afd: AFDConfig
    topology: Topology
    role_rank: int
    tp_rank: int
    connector: Any | None

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()


def fingerprint_of(vllm_config: VllmConfig, afd: AFDConfig) -> Fingerprint:
    """What both roles must agree on before any tensor crosses."""
    hf = vllm_config.model_config.hf_config
    layout = LayerLayout.from_hf_config(hf)
    return Fingerprint(
        arch=hf.architectures[0],
        hidden_size=hf.hidden_size,
        dtype=str(vllm_config.model_config.dtype).removeprefix("torch."),
        num_layers=layout.num_layers,
        moe_layers=layout.moe_layers,
        num_experts=getattr(hf, "n_routed_experts", 0) or 0,
        top_k=getattr(hf, "num_experts_per_tok", 0) or 0,
        num_attention_ranks=afd.num_attention_ranks,
        num_ffn_ranks=afd.num_ffn_ranks,
        compute_gate_on_attention=afd.compute_gate_on_attention,
        connector=afd.connector,
        moe_output_parts=moe_output_parts(vllm_config),
    )


def open_endpoint(
    vllm_config: VllmConfig, afd: AFDConfig, device: torch.device
) -> Endpoint:
    """Create and start this process's connector (TP rank 0 only)."""
    parallel = vllm_config.parallel_config
    topology = Topology(afd.num_attention_ranks, afd.num_ffn_ranks)
    tp_rank = get_tensor_model_parallel_rank()
    role_rank = endpoint_rank(
        topology,
        afd.role,
        dp_rank=parallel.data_parallel_rank,
        dp_size=parallel.data_parallel_size,
        tp_rank=tp_rank,
        ffn_rank=afd.rank,
    )
    fingerprint = fingerprint_of(vllm_config, afd)
    connector = None
    if role_rank is not None:
        connector = factory.create_connector(afd, role_rank, fingerprint, device)
        connector.start()
    rank = role_rank
    if rank is None:
        rank = (afd.rank or 0) if afd.is_ffn else parallel.data_parallel_rank
    peers = topology.peers(afd.role, rank)
    logger.info(
        "AFD %s rank %d/%d (tp rank %d%s): topology %s, peers %s rank(s) %s, "
        "connector %s at %s:%d, protocol v%d, fingerprint %s",
        afd.role.value,
        rank,
        topology.num_ranks(afd.role),
        tp_rank,
        "" if connector is not None else ", follows tp rank 0",
        topology.name,
        "ffn" if afd.is_attention else "attention",
        list(peers),
        afd.connector,
        afd.host,
        afd.port,
        PROTOCOL_VERSION,
        fingerprint.digest,
    )
    return Endpoint(afd, topology, rank, tp_rank, connector)
