"""Which role owns a checkpoint weight: one pure function, table-tested.

Decided over the module prefixes the role split recorded while vLLM built the
model (:class:`SplitPrefixes`), never over a family's config keys::

    weight under                      gate on FFN     gate on attention
    a dense MLP  (layers.i.mlp)       ffn             attention
    an MoE block's gate               ffn             attention
    the rest of an MoE block          ffn             ffn
      (routed and shared experts, the shared expert's own gate)
    anything else                     attention       attention
      (embeddings, attention, norms, lm_head, layers vLLM does not build,
       e.g. DeepSeek-V3's MTP module, which attention's native loader skips)

Prefixes match whole dotted components: ``mlp.gate`` owns ``mlp.gate.weight``
but not ``mlp.gate_proj.weight`` or ``mlp.shared_expert_gate.weight``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_afd.roles import AFDRole


@dataclass(frozen=True)
class SplitPrefixes:
    """Module prefixes of the FFN-side parts, as vLLM built them.

    Attributes:
        moe_blocks: the MoE block of each MoE layer (``model.layers.3.mlp``,
            ``model.layers.3.block_sparse_moe``).
        gates: each MoE block's router gate (``model.layers.3.mlp.gate``).
        dense_mlps: each dense MLP layer (``model.layers.0.mlp``).
        routed_experts: each MoE block's runner (``model.layers.3.mlp.experts``),
            inside its block; not needed for ownership, named for the bytes
            per part.
    """

    moe_blocks: tuple[str, ...]
    gates: tuple[str, ...]
    dense_mlps: tuple[str, ...]
    routed_experts: tuple[str, ...] = ()


def under_any(name: str, prefixes: tuple[str, ...]) -> bool:
    """Whether ``name`` is one of ``prefixes`` or lies under one (whole dotted
    components)."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def weight_owner(
    name: str, prefixes: SplitPrefixes, *, compute_gate_on_attention: bool
) -> AFDRole:
    """The role that loads checkpoint weight ``name``."""
    if under_any(name, prefixes.dense_mlps):
        return AFDRole.ATTENTION if compute_gate_on_attention else AFDRole.FFN
    if under_any(name, prefixes.gates):
        return AFDRole.ATTENTION if compute_gate_on_attention else AFDRole.FFN
    if under_any(name, prefixes.moe_blocks):
        return AFDRole.FFN
    return AFDRole.ATTENTION


def vllm_weight_name(
    name: str,
    map_name: Callable[[str], str | None] | None,
    renames: Sequence[tuple[str, str]] = (),
) -> str:
    """Checkpoint weight ``name`` as vLLM names it, which ownership is
    decided on: through the model's name map (a ``WeightsMapper``'s, None
    where it has none; a name it drops stays as it is), then the renames a
    family's loader makes in its own code (``Family.checkpoint_renames``)."""
    mapped = (map_name(name) if map_name is not None else name) or name
    for checkpoint, vllm in renames:
        mapped = mapped.replace(checkpoint, vllm)
    return mapped
