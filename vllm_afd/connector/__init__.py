"""The AFD connector: the only boundary between the attention and FFN roles.

Build one with :func:`create_connector` and drive it through
:class:`AFDConnector` (see ``connector.py`` for the call sequence).

Names are imported on first use, so ``vllm_afd.connector.factory`` (what
config validation asks) loads without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AFDConnector": "connector",
    "canonical_name": "factory",
    "create_connector": "factory",
    "ExchangeLimits": "factory",
    "registered_names": "factory",
    "validate_extra_config": "factory",
    "A2FBatch": "payloads",
    "ConnectorStats": "payloads",
    "RecvHandle": "payloads",
    "Routing": "payloads",
    "SendHandle": "payloads",
    "MergedPlan": "plan",
    "PROTOCOL_VERSION": "protocol",
    "ExecMode": "protocol",
    "Fingerprint": "protocol",
    "StepPlan": "protocol",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
