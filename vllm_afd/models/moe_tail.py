"""Where an MoE layer's closing add runs, so compiled 16-bit AFD stays exact.

vLLM's MoE runner (vllm/model_executor/layers/fused_moe/runner/moe_runner.py
@ 0.32.0) gets the shared and routed expert outputs from one opaque custom op,
then scales the routed output and adds the two in plain PyTorch::

    shared, routed = moe_forward_shared(...)       # custom op, 16-bit outputs
    routed *= routed_scaling_factor                # (fp16: shared *= 1/scale)
    out = shared + routed
    ... next layer: residual add + RMSNorm

Compiled, Inductor fuses that scale and add into the next layer's residual add
and RMSNorm and computes them in fp32: ``out`` is never rounded to 16 bits. If
the FFN role did the add and shipped ``out``, the attention role would read it
rounded, and greedy output could differ in near-ties. So when the model is
compiled in bf16/fp16 (and the MoE output is not all-reduced, tensor-parallel
size 1), the FFN ships both outputs, ``[T, 2H]`` = shared | routed, and the
attention role runs the same scale and add in its own compiled graph.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from vllm_afd.errors import AFDCompatError

_CAPTURED = "_maybe_apply_routed_scale_to_output"


def closing_add_fused(vllm_config: Any) -> bool:
    """Whether plain vLLM fuses the MoE's closing add into the next norm
    unrounded: compiled, bf16/fp16, and no all-reduce of the sum (TP 1)."""
    from vllm.config import CompilationMode

    compiled = vllm_config.compilation_config.mode != CompilationMode.NONE
    sixteen_bit = vllm_config.model_config.dtype in (torch.bfloat16, torch.float16)
    tp = vllm_config.parallel_config.tensor_parallel_size
    return compiled and sixteen_bit and tp == 1


def moe_output_parts(vllm_config: Any) -> int:
    """F2A columns of an MoE layer in units of H: 2 when the attention role
    must do the closing add itself (see the module docstring), else 1. The
    parts need shared experts."""
    shared = getattr(vllm_config.model_config.hf_config, "n_shared_experts", None)
    return 2 if closing_add_fused(vllm_config) and shared else 1


def routed_scale(config: Any, apply_routed_scale_to_output: bool) -> float:
    """The factor vLLM's MoE runner applies to the routed output (else the
    router already applied it to the top-k weights)."""
    if not apply_routed_scale_to_output:
        return 1.0
    return float(getattr(config, "routed_scaling_factor", 1.0))


def finish_moe_output(
    parts: torch.Tensor, hidden_size: int, scale: float
) -> torch.Tensor:
    """Attention side: the MoE output from the shipped ``[T, 2H]`` parts.

    The same operations, in the same order, as vLLM's MoE runner after its
    custom op, so a compiled graph fuses them exactly as plain vLLM's.
    """
    shared = parts.narrow(-1, 0, hidden_size)
    routed = parts.narrow(-1, hidden_size, hidden_size)
    if scale != 1.0:
        if routed.dtype != torch.float16:
            routed *= scale
        else:
            shared *= 1.0 / scale
    return shared + routed


class MoEOutputParts:
    """FFN side: one MoE layer returning its shared and routed outputs.

    A hook on the layer's MoE runner replaces the step that scales the routed
    output, which is where both outputs are first in hand; it keeps them
    unscaled (the attention role scales). The runner's own sum is computed
    and dropped. :meth:`forward` traces under ``torch.compile`` (the hook is a
    plain attribute side effect), so the FFN compiles the layer as plain
    vLLM compiles it, up to the closing add.
    """

    def __init__(self, mlp: Any) -> None:
        runner = mlp.experts
        native = getattr(type(runner), _CAPTURED, None)
        params = list(inspect.signature(native).parameters) if native else []
        if params != ["self", "shared_output", "fused_output"]:
            raise AFDCompatError(
                f"{type(runner).__qualname__}.{_CAPTURED} is not the vLLM 0.32 "
                f"method AFD expects (parameters {params}); install vLLM 0.32.0"
            )
        self.mlp = mlp
        self._parts: tuple[torch.Tensor, torch.Tensor] | None = None
        setattr(runner, _CAPTURED, self._keep)

    def _keep(
        self, shared_output: torch.Tensor | None, fused_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        if shared_output is None:
            raise AFDCompatError("AFD MoE output parts need shared experts")
        self._parts = (shared_output, fused_output)
        return shared_output, fused_output

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer on ``hidden [T, H]``: ``[T, 2H]`` = shared | routed."""
        self.mlp(hidden)
        if self._parts is None:
            raise AFDCompatError("the MoE runner did not produce its output parts")
        shared, routed = self._parts
        self._parts = None
        return torch.cat((shared, routed), dim=1)
