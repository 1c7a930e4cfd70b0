"""Parameter-free stand-ins for the MLP/MoE on the attention role.

Each proxy takes the native constructor's arguments (it replaces the native
class while the native decoder layer is built), holds no parameters, and in
``forward`` ships the post-attention hidden states to the FFN role through
:func:`vllm_afd.models.exchange.ffn_exchange`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm.model_executor.models import deepseek_v2 as native

from vllm_afd.models.exchange import ffn_exchange


def _layer_idx(prefix: str) -> int:
    # prefix is "model.layers.{i}.mlp"
    parts = prefix.split(".")
    return int(parts[parts.index("layers") + 1])


class AFDMoEProxy(nn.Module):
    """Stands in for ``DeepseekV2MoE``: the whole MoE runs on the FFN role."""

    def __init__(self, *args: Any, prefix: str = "", **kwargs: Any) -> None:
        nn.Module.__init__(self)
        self.layer_idx = _layer_idx(prefix)

    def forward(
        self, hidden_states: torch.Tensor, already_sequence_parallel: bool = False
    ) -> torch.Tensor:
        return ffn_exchange(hidden_states, self.layer_idx)

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, remote"


class AFDDenseProxy(AFDMoEProxy, native.DeepseekV2MLP):
    """Stands in for a dense ``DeepseekV2MLP`` that runs on the FFN role.

    It is an instance of ``DeepseekV2MLP`` so the native decoder applies the
    same fp16 output scaling as for a local dense MLP; the native ``__init__``
    is skipped, so it holds no parameters.
    """
