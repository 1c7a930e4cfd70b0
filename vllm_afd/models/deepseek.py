"""Role-split DeepSeek-V2/V3 for AFD.

Wraps vllm/model_executor/models/deepseek_v2.py @ 0.32.0. The AFD classes
subclass the native ones, keep every module and parameter name, and decide the
role at construction by swapping, for the duration of the native
``__init__`` only, the classes the native code builds:

* attention role: the MLP/MoE at each remote layer becomes a parameter-free
  proxy (:mod:`vllm_afd.models.proxies`); attention, norms, embeddings and
  lm_head are native. The native decoder forward runs unchanged.
* FFN role: attention, norms, embeddings and lm_head become
  ``PPMissingLayer`` (vLLM's own parameter-free placeholder); the dense MLPs
  and MoE blocks are native. :meth:`compute_ffn` runs one layer's MLP/MoE.

Checkpoint weights are filtered by :func:`vllm_afd.models.ownership.weight_owner`
before the native loader sees them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.models import deepseek_v2 as native
from vllm.model_executor.models.utils import PPMissingLayer

from vllm_afd.compat.patching import Patch, scoped_patch
from vllm_afd.config import AFDConfig, afd_config_from_additional
from vllm_afd.connector.payloads import Routing
from vllm_afd.connector.protocol import ExecMode
from vllm_afd.errors import AFDConfigError
from vllm_afd.models.exchange import current_exchange
from vllm_afd.models.moe_tail import MoEOutputParts, moe_output_parts
from vllm_afd.models.ownership import LayerLayout, weight_owner
from vllm_afd.models.proxies import AFDDenseProxy, AFDMoEProxy
from vllm_afd.models.routing import AbsentGate, AFDGateProxy, ShippedRouting

logger = init_logger(__name__)

_MODULE = "vllm.model_executor.models.deepseek_v2"


def _swap(name: str, params: tuple[str, ...] | None) -> Patch:
    return Patch(
        target=f"{_MODULE}:{name}",
        expected_params=params,
        reason=f"build the role-split DeepSeek model without the other role's {name}",
        removal="when vLLM's DeepSeek model accepts per-module factories",
    )


_MOE = _swap(
    "DeepseekV2MoE",
    (
        "config",
        "parallel_config",
        "quant_config",
        "reduce_results",
        "prefix",
        "apply_routed_scale_to_output",
    ),
)
_MLP = _swap(
    "DeepseekV2MLP",
    (
        "hidden_size",
        "intermediate_size",
        "hidden_act",
        "quant_config",
        "reduce_results",
        "is_sequence_parallel",
        "prefix",
    ),
)
_GATE = _swap(
    "GateLinear",
    (
        "input_size",
        "output_size",
        "bias",
        "out_dtype",
        "params_dtype",
        "force_fp32_compute",
        "skip_bias_add",
        "quant_config",
        "prefix",
        "return_bias",
    ),
)
#: modules the FFN role never builds
_FFN_ABSENT = tuple(
    _swap(name, None)
    for name in (
        "DeepseekV2MLAAttention",
        "DeepseekV2Attention",
        "DeepseekAttention",
        "RMSNorm",
        "VocabParallelEmbedding",
        "ParallelLMHead",
    )
)


PARAMETER_GROUPS = (
    "embed_tokens",
    "lm_head",
    "norms",
    "attention",
    "dense_mlp",
    "gate",
    "shared_experts",
    "routed_experts",
)


def parameter_group(name: str) -> str:
    """Which part of the model a parameter belongs to (for per-role bytes)."""
    if ".mlp." in name:
        for group in ("gate", "shared_experts"):
            if f".mlp.{group}." in name:
                return group
        return "routed_experts" if ".mlp.experts." in name else "dense_mlp"
    for group in ("embed_tokens", "lm_head", "self_attn"):
        if group in name:
            return "attention" if group == "self_attn" else group
    return "norms"


class _Absent(PPMissingLayer):
    """Parameter-free stand-in for a module the other role owns."""


_NATIVE_MLP = native.DeepseekV2MLP


class _AbsentDenseMLP:
    """Stand-in for ``DeepseekV2MLP`` on the FFN role when dense layers run on
    attention: absent at a dense ``mlp`` position, native for the MoE's
    ``shared_experts`` (the same class serves both in the native model)."""

    def __new__(cls, *args: object, prefix: str = "", **kwargs: object) -> object:
        if prefix.endswith(".shared_experts"):
            return _NATIVE_MLP(*args, prefix=prefix, **kwargs)
        return _Absent()


def afd_config_of(vllm_config: VllmConfig) -> AFDConfig:
    afd = afd_config_from_additional(vllm_config.additional_config)
    if afd is None:
        raise AFDConfigError(
            "the AFD DeepSeek model was selected without additional_config['afd']"
        )
    return afd


@contextlib.contextmanager
def _role_construction(afd: AFDConfig, *, model_body: bool) -> Iterator[None]:
    """Swap native classes for this role while the native ``__init__`` runs."""
    with contextlib.ExitStack() as stack:
        if afd.is_ffn:
            for patch in _FFN_ABSENT:
                if model_body or patch.target.endswith("ParallelLMHead"):
                    stack.enter_context(scoped_patch(patch, _Absent))
            if model_body and afd.compute_gate_on_attention:
                stack.enter_context(scoped_patch(_MLP, _AbsentDenseMLP))
                stack.enter_context(scoped_patch(_GATE, AbsentGate))
        elif model_body:
            if afd.compute_gate_on_attention:
                stack.enter_context(scoped_patch(_MOE, AFDGateProxy))
            else:
                stack.enter_context(scoped_patch(_MOE, AFDMoEProxy))
                stack.enter_context(scoped_patch(_MLP, AFDDenseProxy))
        yield


class AFDDeepseekV2Model(native.DeepseekV2Model):
    """``DeepseekV2Model`` holding only this role's modules."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        afd = afd_config_of(vllm_config)
        with _role_construction(afd, model_body=True):
            super().__init__(vllm_config=vllm_config, prefix=prefix)


class AFDDeepseekV2ForCausalLM(native.DeepseekV2ForCausalLM):
    """Role-split ``DeepseekV2ForCausalLM`` (also serves DeepSeek-V3)."""

    model_cls = AFDDeepseekV2Model

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        afd = afd_config_of(vllm_config)
        with _role_construction(afd, model_body=False):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.afd = afd
        self.layout = LayerLayout.from_hf_config(self.config)
        self.remote_layers = self.layout.remote_layers(afd.compute_gate_on_attention)
        self.shipped_routing: dict[int, ShippedRouting] = {}
        self.compiled_ffn: dict[int, torch.nn.Module] = {}
        # MoE layers whose shared and routed outputs ship apart (moe_tail).
        self.moe_parts: dict[int, MoEOutputParts] = {}
        if afd.is_ffn and afd.compute_gate_on_attention:
            self.shipped_routing = {
                i: ShippedRouting(self.model.layers[i].mlp.experts.router)
                for i in self.layout.moe_layers
            }
        if afd.is_ffn and moe_output_parts(vllm_config) == 2:
            self.moe_parts = {
                i: MoEOutputParts(self.model.layers[i].mlp)
                for i in self.layout.moe_layers
            }
        logger.info(
            "AFD %s model: %d layers, remote MLP/MoE layers %s, parameter "
            "bytes by group %s",
            afd.role.value,
            self.layout.num_layers,
            list(self.remote_layers),
            json.dumps(self.parameter_bytes()),
        )

    def parameter_bytes(self) -> dict[str, int]:
        """Bytes of the parameters this role holds, by :func:`parameter_group`."""
        groups: dict[str, int] = dict.fromkeys(PARAMETER_GROUPS, 0)
        for name, param in self.named_parameters():
            groups[parameter_group(name)] += param.numel() * param.element_size()
        return groups

    # ---- attention role -------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: object | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not self.afd.is_attention:
            raise AFDConfigError(
                "the AFD FFN role does not run the decoder forward; it is "
                "driven by the connector"
            )
        current_exchange().begin_forward(
            int(positions.shape[0]), _forward_mode(positions)
        )
        return super().forward(
            input_ids, positions, intermediate_tensors, inputs_embeds
        )

    # ---- FFN role -------------------------------------------------------
    def compute_ffn(
        self, layer_idx: int, hidden: torch.Tensor, routing: Routing | None = None
    ) -> torch.Tensor:
        """Run layer ``layer_idx``'s dense MLP or MoE on ``hidden [T, H]``.

        With ``compute_gate_on_attention`` the routing computed on attention
        (``topk_weights``/``topk_ids [T, K]``) replaces the gate. MoE layers
        in :attr:`moe_parts` return ``[T, 2H]``: shared | routed outputs.
        """
        if routing is not None:
            self.shipped_routing[layer_idx].use(routing.topk_weights, routing.topk_ids)
        return self._ffn_fn(layer_idx)(hidden)

    def _ffn_fn(self, layer_idx: int) -> Any:
        compiled = self.compiled_ffn.get(layer_idx)
        if compiled is not None:
            return compiled
        parts = self.moe_parts.get(layer_idx)
        return parts.forward if parts is not None else self.model.layers[layer_idx].mlp

    def compile_ffn(self) -> None:
        """``torch.compile`` each remote MLP/MoE, as vLLM compiles the model.

        When the attention role runs compiled, plain vLLM fuses the
        element-wise tail of each MoE (routed scaling, shared + routed add)
        in one compiled kernel that rounds once; the FFN role must do the
        same to stay exact in bf16. Called before the FFN loop starts.
        """
        import torch._dynamo

        limit = 4 * len(self.remote_layers) + 8
        torch._dynamo.config.cache_size_limit = max(
            torch._dynamo.config.cache_size_limit, limit
        )
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 4 * limit
        )
        self.compiled_ffn = {
            i: torch.compile(self._ffn_fn(i), dynamic=True) for i in self.remote_layers
        }

    # ---- both -----------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        role = self.afd.role
        gate_on_attn = self.afd.compute_gate_on_attention
        mine = (
            (name, tensor)
            for name, tensor in weights
            if weight_owner(name, self.layout, compute_gate_on_attention=gate_on_attn)
            is role
        )
        return super().load_weights(mine)


def _forward_mode(positions: torch.Tensor) -> ExecMode:
    """How the FFN must serve the forward that is starting.

    CAPTURE when CUDA graphs are being recorded around the exchanges: a FULL
    graph (the stream is capturing now), or the piecewise graphs vLLM records
    inside this forward. REPLAY when this forward replays piecewise graphs,
    which hold the exchanges as they hold every op between two attention
    layers (a FULL replay never runs the forward; the runner announces it).
    WARMUP for profile, compile and idle (dummy) forwards, which carry no
    attention metadata and may compile on the way, so the FFN waits longer,
    and for the eager warm-up runs the runner makes while it records graphs
    (dummy batches too; a profiler waiting for served steps skips them).
    EAGER otherwise.
    """
    if positions.is_cuda and torch.cuda.is_current_stream_capturing():
        return ExecMode.CAPTURE
    context = get_forward_context()
    if context.cudagraph_runtime_mode == CUDAGraphMode.PIECEWISE:
        capturing = current_exchange().capturing_graphs
        return ExecMode.CAPTURE if capturing else ExecMode.REPLAY
    if context.attn_metadata is None or current_exchange().capturing_graphs:
        return ExecMode.WARMUP
    return ExecMode.EAGER


class AFDDeepseekV3ForCausalLM(AFDDeepseekV2ForCausalLM):
    """Role-split ``DeepseekV3ForCausalLM`` (same native code as V2)."""
