"""Stand-ins the role split builds in place of the other role's modules.

Wraps vllm/model_executor/layers/fused_moe/layer.py (``FusedMoEFactory``) and
runner/moe_runner.py (``MoERunner``) @ 0.32.0. On the attention role vLLM's MoE
factory builds :class:`AFDRemoteRunner` instead of ``MoERunner`` and
:class:`AbsentRoutedExperts` instead of ``RoutedExperts``; the model's MoE block
stays native and calls the runner as it would call vLLM's::

    attention role, MoE layer i                      FFN role
    block(hidden)
      [gate(hidden) -> logits]   (router before the runner; a stand-in unless
                                  the gate runs on attention)
      runner(hidden, logits)
        gate on FFN:       ship hidden [T, H]  ──A2F──▶  block(hidden)
        gate on attention: w, ids = router(...)
                           ship hidden, w, ids ──A2F──▶  runner(hidden) with
                                                         the shipped (w, ids)
        out [T, H] (or shared | routed [T, 2H]) ◀──F2A──
        ... the same closing steps as vLLM's runner

Parameter-free stand-ins (:class:`Absent`, :class:`AbsentGate`) replace what a
role does not hold; a dense MLP that runs on the FFN role becomes a
:func:`remote_dense_class` instance, so the decoder layer's own checks on the
MLP's class still hold.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm.model_executor.models.utils import PPMissingLayer

from vllm_afd.errors import AFDConfigError
from vllm_afd.models.exchange import (
    ffn_exchange,
    ffn_exchange_routed,
    ffn_exchange_routed_out,
)
from vllm_afd.models.moe_tail import finish_moe_output


def layer_index(prefix: str) -> int:
    """The decoder layer of a module prefix: the first integer component
    (``model.layers.3.mlp.experts`` -> 3)."""
    for part in prefix.split("."):
        if part.isdigit():
            return int(part)
    raise AFDConfigError(f"module prefix {prefix!r} names no decoder layer")


class Absent(PPMissingLayer):
    """Parameter-free stand-in for a module the other role owns."""

    def tie_weights(self, embed_tokens: nn.Module) -> Absent:
        # lm_head tied to the embeddings: neither is held by this role.
        return self


class AbsentGate(nn.Module):
    """Parameter-free stand-in for the router gate where it does not run.

    Its logits are never read (the other role routes), so it returns an empty
    ``[T, 0]`` tensor. The native MoE block may give its gate an
    ``e_score_correction_bias`` parameter; the stand-in keeps it as None.
    """

    def __init__(self, *args: Any, out_dtype: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self.out_dtype = out_dtype

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "e_score_correction_bias":
            value = None
        super().__setattr__(name, value)

    def set_out_dtype(self, out_dtype: Any) -> None:
        self.out_dtype = out_dtype

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        return hidden_states.new_empty((hidden_states.shape[0], 0)), None


class AbsentRoutedExperts(nn.Module):
    """Stands in for vLLM's ``RoutedExperts`` on the attention role: no expert
    weights (built by the factory with the native arguments, all unused)."""

    def __init__(self, layer_name: str, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.layer_name = layer_name


class AFDRemoteRunner(nn.Module):
    """Stands in for vLLM's ``MoERunner`` on the attention role.

    Built by vLLM's own MoE factory with the native runner's arguments, so it
    knows the layer's MoE config, router and (runner-held) gate as vLLM built
    them. It holds no parameters: the gate, when it runs here, is the MoE
    block's own module. :meth:`forward` ships the layer to the FFN role.

    Attributes:
        layer_idx: the decoder layer.
        moe_config: vLLM's ``FusedMoEConfig`` of the layer.
        has_shared_experts: the native runner would hold shared experts.
        routes: the router runs here (``compute_gate_on_attention``).
        parts: F2A columns in units of H (2: shared | routed, added here).
    """

    def __init__(
        self,
        layer_name: str,
        moe_config: Any,
        router: Any,
        routed_experts: Any,
        enable_dbo: bool = False,
        gate: nn.Module | None = None,
        shared_experts: nn.Module | None = None,
        shared_expert_gate: nn.Module | None = None,
        routed_input_transform: nn.Module | None = None,
        routed_output_transform: nn.Module | None = None,
        routed_scaling_factor: float = 1.0,
    ) -> None:
        super().__init__()
        if routed_input_transform is not None or routed_output_transform is not None:
            raise AFDConfigError(
                f"{layer_name}: AFD does not split latent MoE layers (routed "
                "input/output transforms run inside the MoE runner)"
            )
        self.layer_name = layer_name
        self.layer_idx = layer_index(layer_name)
        self.moe_config = moe_config
        self.has_shared_experts = shared_experts is not None
        self.routed_scaling_factor = routed_scaling_factor
        self.routes = False
        self.parts = 1
        # the exchange is a splitting op of piecewise graphs (async connector)
        self.splits_graphs = False
        # Not registered as submodules: the block owns the gate, and the router
        # is only used when it routes here.
        self.__dict__["router"] = router
        self.__dict__["runner_gate"] = gate

    @property
    def gate(self) -> nn.Module | None:
        return self.__dict__["runner_gate"]

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        input_ids: torch.Tensor | None = None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.routes:
            logits = router_logits
            if self.gate is not None:
                logits, _ = self.gate(hidden_states)
            topk_weights, topk_ids = self.router.select_experts(
                hidden_states=hidden_states, router_logits=logits
            )
            exchange = (
                ffn_exchange_routed_out if self.splits_graphs else ffn_exchange_routed
            )
            out = exchange(
                hidden_states, topk_weights, topk_ids, self.layer_idx, self.parts
            )
        else:
            out = ffn_exchange(hidden_states, self.layer_idx, self.parts)
        if self.parts == 1:
            return out
        return finish_moe_output(
            out, hidden_states.shape[-1], self.routed_scaling_factor
        )

    def update_expert_map(self) -> None:
        # Expert placement is the FFN role's; nothing to map here.
        return None

    def extra_repr(self) -> str:
        where = "attention" if self.routes else "ffn"
        return (
            f"layer_idx={self.layer_idx}, remote, router on {where}, parts={self.parts}"
        )


class _RemoteDense(nn.Module):
    """A dense MLP that runs on the FFN role (mixed before the native class)."""

    def __init__(self, *args: Any, prefix: str = "", **kwargs: Any) -> None:
        nn.Module.__init__(self)  # the native __init__ would build weights
        self.layer_idx = layer_index(prefix)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return ffn_exchange(x, self.layer_idx, 1)

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, remote"


_REMOTE_DENSE: dict[type, type] = {}


def remote_dense_class(native: type) -> type:
    """A parameter-free subclass of the dense MLP class ``native`` whose
    forward ships to the FFN role (an instance of ``native``, so the decoder
    layer's ``isinstance`` checks on its MLP hold)."""
    if native not in _REMOTE_DENSE:
        _REMOTE_DENSE[native] = type(
            f"AFDRemote{native.__name__}", (_RemoteDense, native), {}
        )
    return _REMOTE_DENSE[native]


def is_decoder_mlp(prefix: str) -> bool:
    """Whether ``prefix`` is a decoder layer's own MLP (``…layers.0.mlp``), not
    one nested inside an MoE block (``…layers.3.mlp.shared_experts``)."""
    parts = prefix.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return len(parts) == i + 2
    return False
