"""The role split of one model, as read from what vLLM built (no vLLM import).

:func:`vllm_afd.models.split.derive_split` fills a :class:`ModelSplit` once per
worker from the modules vLLM constructed (each MoE runner, its ``FusedMoEConfig``
and the recorded prefixes); the handshake fingerprint, the FFN loop, the TP
relay, the weight filter and the logs all read this one record.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from vllm_afd.models.ownership import SplitPrefixes


@dataclass(frozen=True)
class ModelSplit:
    """Where each decoder layer's MLP/MoE runs, and its shapes.

    Attributes:
        arch: the Hugging Face architecture served.
        num_layers: decoder layers vLLM built.
        hidden_size: H, the MoE input width.
        moe_layers: layers with an MoE block (vLLM's MoE runner).
        dense_layers: layers with a dense MLP.
        remote_layers: layers whose MLP/MoE runs on the FFN role, in forward
            order: every MoE and dense layer, or only the MoE layers when the
            gate (and the dense MLPs) run on attention.
        num_experts: routed experts per MoE layer (global).
        top_k: K, routed experts per token.
        shared_experts: every MoE layer has shared experts.
        moe_output_parts: F2A columns of an MoE layer in units of H (1, or 2
            when shared and routed outputs ship apart; ``models.moe_tail``).
        prefixes: module prefixes of the FFN-side parts (weight ownership).
    """

    arch: str
    num_layers: int
    hidden_size: int
    moe_layers: tuple[int, ...]
    dense_layers: tuple[int, ...]
    remote_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    shared_experts: bool
    moe_output_parts: int
    prefixes: SplitPrefixes

    def summary(self) -> dict[str, Any]:
        """The split without prefixes, as plain JSON values."""
        d = dataclasses.asdict(self)
        del d["prefixes"]
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


#: the INFO line each role logs once its model is built
_MODEL_LINE = re.compile(
    r"AFD (?P<role>attention|ffn) model: split (?P<split>\{.*?\}); parameter "
    r"bytes by group (?P<groups>\{.*\})"
)


def model_log_line(role: str, split: ModelSplit, groups: dict[str, int]) -> str:
    """``AFD <role> model: split {...}; parameter bytes by group {...}``."""
    return (
        f"AFD {role} model: split {json.dumps(split.summary())}; parameter "
        f"bytes by group {json.dumps(groups)}"
    )


def parse_model_line(line: str) -> tuple[str, dict[str, Any], dict[str, int]] | None:
    """(role, split summary, bytes by group) of a :func:`model_log_line`."""
    match = _MODEL_LINE.search(line)
    if match is None:
        return None
    return (
        match.group("role"),
        json.loads(match.group("split")),
        json.loads(match.group("groups")),
    )
