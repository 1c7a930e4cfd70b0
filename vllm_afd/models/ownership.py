"""Which role owns a checkpoint weight: one pure function, table-tested.

DeepSeek-V2/V3 checkpoint names (``model.layers.{i}.…``)::

    weight                                 gate on FFN     gate on attention
    embed_tokens, norm, lm_head            attention       attention
    layers.i.self_attn.*, *_layernorm      attention       attention
    layers.i.mlp.*      (dense layer)      ffn             attention
    layers.i.mlp.gate.* (MoE layer)        ffn             attention
    layers.i.mlp.experts.*, shared_experts ffn             ffn

Layers at or beyond ``num_hidden_layers`` (DeepSeek-V3's MTP module) go to
attention, whose native loader skips them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from vllm_afd.config import AFDRole

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


@dataclass(frozen=True)
class LayerLayout:
    """The dense/MoE pattern of a DeepSeek decoder stack."""

    num_layers: int
    first_k_dense_replace: int
    moe_layer_freq: int = 1
    has_experts: bool = True

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> LayerLayout:
        return cls(
            num_layers=hf_config.num_hidden_layers,
            first_k_dense_replace=getattr(hf_config, "first_k_dense_replace", 0),
            moe_layer_freq=getattr(hf_config, "moe_layer_freq", 1),
            has_experts=getattr(hf_config, "n_routed_experts", None) is not None,
        )

    def is_moe(self, layer_idx: int) -> bool:
        """Same rule as vLLM's ``DeepseekV2DecoderLayer``."""
        return (
            self.has_experts
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe(i))

    def remote_layers(self, compute_gate_on_attention: bool) -> tuple[int, ...]:
        """Layers whose MLP/MoE runs on the FFN role, in forward order."""
        if compute_gate_on_attention:
            return self.moe_layers
        return tuple(range(self.num_layers))


def weight_owner(
    name: str, layout: LayerLayout, *, compute_gate_on_attention: bool
) -> AFDRole:
    """The role that loads checkpoint weight ``name``."""
    match = _LAYER.match(name)
    if match is None:
        return AFDRole.ATTENTION
    layer_idx, rest = int(match.group(1)), match.group(2)
    if layer_idx >= layout.num_layers or not rest.startswith("mlp."):
        return AFDRole.ATTENTION
    if not layout.is_moe(layer_idx):
        return AFDRole.ATTENTION if compute_gate_on_attention else AFDRole.FFN
    if rest.startswith("mlp.gate.") and compute_gate_on_attention:
        return AFDRole.ATTENTION
    return AFDRole.FFN
