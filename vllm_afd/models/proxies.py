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
from vllm.config import get_current_vllm_config
from vllm.model_executor.models import deepseek_v2 as native

from vllm_afd.models.exchange import ffn_exchange
from vllm_afd.models.moe_tail import finish_moe_output, moe_output_parts, routed_scale


def _layer_idx(prefix: str) -> int:
    # prefix is "model.layers.{i}.mlp"
    parts = prefix.split(".")
    return int(parts[parts.index("layers") + 1])


class AFDMoEProxy(nn.Module):
    """Stands in for ``DeepseekV2MoE``: the whole MoE runs on the FFN role.

    When the FFN ships the shared and routed expert outputs apart
    (:mod:`vllm_afd.models.moe_tail`), the proxy scales and adds them here, as
    vLLM's MoE runner would.
    """

    def __init__(self, *args: Any, prefix: str = "", **kwargs: Any) -> None:
        nn.Module.__init__(self)
        self.layer_idx = _layer_idx(prefix)
        self.parts, self.scale = 1, 1.0
        config = kwargs.get("config")
        if config is not None:  # an MoE layer (a dense MLP gets no config)
            self.set_moe_tail(config, kwargs.get("apply_routed_scale_to_output"))

    def set_moe_tail(self, config: Any, apply_routed_scale_to_output: Any) -> None:
        self.parts = moe_output_parts(get_current_vllm_config())
        self.scale = routed_scale(config, bool(apply_routed_scale_to_output))

    def forward(
        self, hidden_states: torch.Tensor, already_sequence_parallel: bool = False
    ) -> torch.Tensor:
        out = ffn_exchange(hidden_states, self.layer_idx, self.parts)
        return self.finish(out, hidden_states.shape[-1])

    def finish(self, out: torch.Tensor, hidden_size: int) -> torch.Tensor:
        if self.parts == 1:
            return out
        return finish_moe_output(out, hidden_size, self.scale)

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, remote, parts={self.parts}"


class AFDDenseProxy(AFDMoEProxy, native.DeepseekV2MLP):
    """Stands in for a dense ``DeepseekV2MLP`` that runs on the FFN role.

    It is an instance of ``DeepseekV2MLP`` so the native decoder applies the
    same fp16 output scaling as for a local dense MLP; the native ``__init__``
    is skipped, so it holds no parameters.
    """
