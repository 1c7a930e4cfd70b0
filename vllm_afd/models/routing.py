"""``compute_gate_on_attention``: the router runs on attention, experts on FFN.

Wraps the routing of vllm/model_executor/models/deepseek_v2.py:DeepseekV2MoE
and vllm/model_executor/layers/fused_moe/layer.py @ 0.32.0::

    attention role (MoE layer)                    FFN role (MoE layer)
    logits = gate(hidden)          [T, E]
    w, ids = router(hidden, logits) [T, K] ──A2F──▶ experts(hidden, w, ids)
                                                   + shared experts
    hidden                          [T, H] ──A2F──▶
    out                             [T, H] ◀──F2A──

The attention side builds the gate (same module and parameter names as the
native one) and a router made by vLLM's own router factory with the
arguments the native MoE layer would pass, so ``(w, ids)`` are the ones the
native layer computes. The FFN side builds the native MoE with a
parameter-free stand-in for the gate and serves the shipped ``(w, ids)`` to
the native experts through its router.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm.model_executor.layers.fused_moe.router.router_factory import (
    create_fused_moe_router,
)
from vllm.model_executor.models import deepseek_v2 as native

from vllm_afd.models.exchange import ffn_exchange_routed
from vllm_afd.models.proxies import AFDMoEProxy


def native_router(config: Any, apply_routed_scale_to_output: bool) -> Any:
    """The router vLLM's MoE layer builds for this DeepSeek config."""
    bias = None
    if getattr(config, "topk_method", None) == "noaux_tc":
        bias = nn.Parameter(torch.empty(config.n_routed_experts, dtype=torch.float32))
    factor = getattr(config, "routed_scaling_factor", 1.0)
    router = create_fused_moe_router(
        top_k=config.num_experts_per_tok,
        global_num_experts=config.n_routed_experts,
        renormalize=config.norm_topk_prob,
        use_grouped_topk=True,
        num_expert_group=getattr(config, "n_group", 1),
        topk_group=getattr(config, "topk_group", 1),
        scoring_func=getattr(config, "scoring_func", "softmax"),
        # As the native layer: the runner scales the output instead.
        routed_scaling_factor=1.0 if apply_routed_scale_to_output else factor,
        e_score_correction_bias=bias,
    )
    return router, bias


class AFDGateProxy(AFDMoEProxy):
    """Stands in for ``DeepseekV2MoE`` on attention when the gate runs there.

    Holds the gate (``mlp.gate.weight`` and, for DeepSeek-V3,
    ``mlp.gate.e_score_correction_bias``); ships top-k weights and ids.
    """

    def __init__(
        self,
        config: Any,
        parallel_config: Any = None,
        quant_config: Any = None,
        reduce_results: bool = True,
        prefix: str = "",
        apply_routed_scale_to_output: bool = False,
    ) -> None:
        super().__init__(prefix=prefix)
        self.gate = native.GateLinear(
            config.hidden_size,
            config.n_routed_experts,
            out_dtype=native._get_moe_router_dtype(config),
            prefix=f"{prefix}.gate",
        )
        self.router, bias = native_router(config, apply_routed_scale_to_output)
        self.gate.e_score_correction_bias = bias
        self.set_moe_tail(config, apply_routed_scale_to_output)

    def forward(
        self, hidden_states: torch.Tensor, already_sequence_parallel: bool = False
    ) -> torch.Tensor:
        logits, _ = self.gate(hidden_states)
        topk_weights, topk_ids = self.router.select_experts(
            hidden_states=hidden_states, router_logits=logits
        )
        out = ffn_exchange_routed(
            hidden_states, topk_weights, topk_ids, self.layer_idx, self.parts
        )
        return self.finish(out, hidden_states.shape[-1])


class AbsentGate(nn.Module):
    """Parameter-free stand-in for ``GateLinear`` on the FFN role.

    The native MoE assigns ``e_score_correction_bias`` to its gate; the FFN
    does not hold it (the router runs on attention), so it is kept as None.
    """

    def __init__(self, *args: Any, out_dtype: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self.out_dtype = out_dtype
        self.num_experts = args[1] if len(args) > 1 else kwargs.get("output_size")

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "e_score_correction_bias":
            value = None
        super().__setattr__(name, value)

    def set_out_dtype(self, out_dtype: Any) -> None:
        self.out_dtype = out_dtype

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Logits are never used: the shipped routing replaces them.
        return hidden_states.new_empty((hidden_states.shape[0], 0)), None


class ShippedRouting:
    """Serves the routing shipped from attention to one native MoE runner.

    Installed as the runner's router ``select_experts``; :meth:`use` sets the
    routing of the next call.
    """

    def __init__(self, router: Any) -> None:
        self.router = router
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        router.select_experts = self

    def use(self, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
        self.pending = (topk_weights, topk_ids)

    def __call__(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        topk_indices_dtype: torch.dtype | None = None,
        *,
        input_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pending is None:
            raise RuntimeError("AFD FFN MoE ran without the routing from attention")
        topk_weights, topk_ids = self.pending
        self.pending = None
        if topk_indices_dtype is not None:
            topk_ids = topk_ids.to(topk_indices_dtype)
        return topk_weights, topk_ids
