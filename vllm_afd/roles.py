"""The two roles of an AFD deployment (a leaf module: imports nothing)."""

from __future__ import annotations

import enum


class AFDRole(str, enum.Enum):
    """Which half of the model a process serves."""

    ATTENTION = "attention"
    FFN = "ffn"
