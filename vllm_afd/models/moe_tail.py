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
attention role runs the same scale and add in its own compiled graph. That
needs shared experts in every MoE layer (``ModelSplit.moe_output_parts``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_afd.compat.patching import Patch, check_patch
from vllm_afd.errors import AFDCompatError

_CAPTURED = "_maybe_apply_routed_scale_to_output"
ROUTED_SCALE = Patch(
    target="vllm.model_executor.layers.fused_moe.runner.moe_runner:"
    f"MoERunner.{_CAPTURED}",
    expected_params=("self", "shared_output", "fused_output"),
    reason="FFN role, compiled 16-bit: keep each MoE layer's shared and routed "
    "outputs apart (one instance attribute per layer) so attention adds them",
    removal="when vLLM's MoE runner can return its outputs unsummed",
)


def closing_add_fused(vllm_config: Any) -> bool:
    """Whether plain vLLM fuses the MoE's closing add into the next norm
    unrounded: compiled, bf16/fp16, and no all-reduce of the sum (TP 1)."""
    from vllm.config import CompilationMode

    compiled = vllm_config.compilation_config.mode != CompilationMode.NONE
    sixteen_bit = vllm_config.model_config.dtype in (torch.bfloat16, torch.float16)
    tp = vllm_config.parallel_config.tensor_parallel_size
    return compiled and sixteen_bit and tp == 1


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

    Args:
        layer: runs the layer on ``hidden [T, H]`` (the MoE block, or the
            runner with shipped routing); it calls ``runner``.
        runner: the layer's native MoE runner.
    """

    def __init__(self, layer: Callable[[torch.Tensor], torch.Tensor], runner: Any):
        check_patch(ROUTED_SCALE)
        self.layer = layer
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
        self.layer(hidden)
        if self._parts is None:
            raise AFDCompatError("the MoE runner did not produce its output parts")
        shared, routed = self._parts
        self._parts = None
        return torch.cat((shared, routed), dim=1)
