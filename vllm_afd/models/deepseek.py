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
from collections.abc import Iterable, Iterator

import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.models import deepseek_v2 as native
from vllm.model_executor.models.utils import PPMissingLayer

from vllm_afd.compat.patching import Patch, scoped_patch
from vllm_afd.config import AFDConfig, AFDRole, afd_config_from_additional
from vllm_afd.errors import AFDConfigError
from vllm_afd.models.exchange import current_exchange
from vllm_afd.models.ownership import LayerLayout, weight_owner
from vllm_afd.models.proxies import AFDDenseProxy, AFDMoEProxy

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


class _Absent(PPMissingLayer):
    """Parameter-free stand-in for a module the other role owns."""


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
                stack.enter_context(scoped_patch(_MLP, _Absent))
        elif model_body:
            stack.enter_context(scoped_patch(_MOE, AFDMoEProxy))
            if not afd.compute_gate_on_attention:
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
        logger.info(
            "AFD %s model: %d layers, remote MLP/MoE layers %s, %.2f MiB of "
            "parameters on this role",
            afd.role.value,
            self.layout.num_layers,
            list(self.remote_layers),
            self.parameter_bytes() / 2**20,
        )

    def parameter_bytes(self) -> int:
        """Bytes of every parameter this role holds."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

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
        current_exchange().begin_step(int(positions.shape[0]))
        return super().forward(
            input_ids, positions, intermediate_tensors, inputs_embeds
        )

    # ---- FFN role -------------------------------------------------------
    def compute_ffn(self, layer_idx: int, hidden: torch.Tensor) -> torch.Tensor:
        """Run layer ``layer_idx``'s dense MLP or MoE on ``hidden [T, H]``."""
        return self.model.layers[layer_idx].mlp(hidden)

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


class AFDDeepseekV3ForCausalLM(AFDDeepseekV2ForCausalLM):
    """Role-split ``DeepseekV3ForCausalLM`` (same native code as V2)."""


def role_of(model: torch.nn.Module) -> AFDRole:
    return model.afd.role  # type: ignore[attr-defined]
