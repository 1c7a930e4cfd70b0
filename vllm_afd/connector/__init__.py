"""The AFD connector: the only boundary between the attention and FFN roles.

Build one with :func:`create_connector` and drive it through
:class:`AFDConnector` (see ``connector.py`` for the call sequence).
"""

from __future__ import annotations

from vllm_afd.connector.connector import AFDConnector
from vllm_afd.connector.factory import (
    canonical_name,
    create_connector,
    registered_names,
    validate_extra_config,
)
from vllm_afd.connector.payloads import (
    A2FBatch,
    ConnectorStats,
    RecvHandle,
    Routing,
    SendHandle,
)
from vllm_afd.connector.plan import MergedPlan
from vllm_afd.connector.protocol import (
    PROTOCOL_VERSION,
    ExecMode,
    Fingerprint,
    StepPlan,
)

__all__ = [
    "PROTOCOL_VERSION",
    "A2FBatch",
    "AFDConnector",
    "ConnectorStats",
    "ExecMode",
    "Fingerprint",
    "MergedPlan",
    "RecvHandle",
    "Routing",
    "SendHandle",
    "StepPlan",
    "canonical_name",
    "create_connector",
    "registered_names",
    "validate_extra_config",
]
