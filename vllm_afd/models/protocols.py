"""What the workers need from a role-split model (the seam, declared).

Implemented by :class:`vllm_afd.models.split.RoleSplitMixin` for every
supported family; the workers and the FFN loop see only this.
"""

from __future__ import annotations

from typing import Protocol

import torch

from vllm_afd.config import AFDConfig
from vllm_afd.connector.payloads import Routing
from vllm_afd.models.layout import ModelSplit


class RoleSplitModel(Protocol):
    """A model holding one role's half, split as :attr:`afd_split` says; its
    :attr:`afd` is the config parsed once when the model was built (the
    runners read it there)."""

    afd: AFDConfig
    afd_split: ModelSplit

    def compute_ffn(
        self, layer_idx: int, hidden: torch.Tensor, routing: Routing | None = None
    ) -> torch.Tensor:
        """FFN role: layer ``layer_idx`` on ``hidden [T, H]`` (routing
        ``[T, K]`` when the gate runs on attention); ``[T, parts * H]``."""
        ...

    def compile_ffn(self) -> None:
        """FFN role: ``torch.compile`` every remote layer."""
        ...

    def keep_ffn_experts(
        self, lo: int, hi: int, keep_shared: bool = True
    ) -> tuple[int, int]:
        """FFN role: keep routed experts ``[lo, hi)`` only (and the shared
        experts if ``keep_shared``); (routed-expert bytes kept, before)."""
        ...

    def parameter_bytes(self) -> dict[str, int]:
        """Bytes this role holds, by part of the model."""
        ...
