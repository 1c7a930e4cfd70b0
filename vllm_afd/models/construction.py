"""Build a role's half of any supported MoE model: the scoped patches.

Wraps vllm/model_executor/layers/fused_moe/layer.py:FusedMoEFactory @ 0.32.0,
which looks ``MoERunner`` and ``RoutedExperts`` up by name each time a model
builds an MoE layer, and the family module named by the family record
(:mod:`vllm_afd.models.families`). For the duration of the native model's
``__init__`` only::

    attention role                             FFN role
    MoERunner      -> AFDRemoteRunner          (native)
    RoutedExperts  -> AbsentRoutedExperts      (native)
    FusedMoEConfig -> any intermediate width   (native)
    GateLinear     -> AbsentGate (gate on FFN) AbsentGate (gate on attention)
    dense MLP      -> remote (gate on FFN)     absent (gate on attention)
    shared experts -> absent                   (native)
    attention classes, RMSNorm, embeddings,
    lm_head        (native)                    -> Absent

Shared experts and dense MLPs are one class in every family; the stand-in
tells them apart by prefix and records each dense MLP it builds
(:class:`Recorded`), so ownership reads the prefixes vLLM built.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from vllm_afd.compat.patching import Patch, check_patch, scoped_patch
from vllm_afd.config import AFDConfig
from vllm_afd.models.families import Family
from vllm_afd.models.remote import (
    Absent,
    AbsentGate,
    AbsentRoutedExperts,
    AFDRemoteRunner,
    is_decoder_mlp,
    remote_dense_class,
)

_FACTORY = "vllm.model_executor.layers.fused_moe.layer"

RUNNER = Patch(
    target=f"{_FACTORY}:MoERunner",
    expected_params=(
        "layer_name",
        "moe_config",
        "router",
        "routed_experts",
        "enable_dbo",
        "gate",
        "shared_experts",
        "shared_expert_gate",
        "routed_input_transform",
        "routed_output_transform",
        "routed_scaling_factor",
    ),
    reason="attention role: vLLM's MoE factory builds a runner that ships the "
    "layer to the FFN role instead of running the experts",
    removal="when vLLM's MoE factory accepts a runner class per model load",
)
ROUTED_EXPERTS = Patch(
    target=f"{_FACTORY}:RoutedExperts",
    expected_params=None,  # replaced by a stand-in that takes any arguments
    reason="attention role: no routed-expert weights",
    removal="when vLLM's MoE factory accepts a routed-experts class per load",
)

MOE_CONFIG = Patch(
    target=f"{_FACTORY}:FusedMoEConfig",
    expected_params=None,  # wrapped as (**kwargs): the factory passes keywords
    reason="attention role: vLLM shards the experts' intermediate size over "
    "the data-parallel x tensor-parallel ranks and asserts that it divides; "
    "the attention role holds no experts, so any rank count must build",
    removal="when vLLM checks the intermediate size only where experts are built",
)


def any_width_moe_config(native: Any) -> Any:
    """vLLM's ``FusedMoEConfig`` with the intermediate size rounded up to a
    multiple of the ranks it is sharded over (the attention role's MoE layers
    hold no experts: the size shapes nothing there, but vLLM asserts that it
    divides, so 3 attention ranks of a model of width 64 would not start)."""

    def build(**kwargs: Any) -> Any:
        ranks = kwargs["moe_parallel_config"].tp_size
        kwargs["intermediate_size"] = -(-kwargs["intermediate_size"] // ranks) * ranks
        return native(**kwargs)

    return build


#: vLLM's generic layers the FFN role does not build, (module, class), under
#: whatever name a family module imports them (Qwen3-Next: ``GemmaRMSNorm as
#: Qwen3NextRMSNorm``)
FFN_ABSENT_LAYERS = (
    ("vllm.model_executor.layers.layernorm", "RMSNorm"),
    ("vllm.model_executor.layers.layernorm", "GemmaRMSNorm"),
    ("vllm.model_executor.layers.vocab_parallel_embedding", "VocabParallelEmbedding"),
    ("vllm.model_executor.layers.vocab_parallel_embedding", "ParallelLMHead"),
)


def ffn_absent_names(module: Any) -> list[str]:
    """The names under which ``module`` holds a class of
    :data:`FFN_ABSENT_LAYERS`."""
    absent = {
        getattr(importlib.import_module(path), name) for path, name in FFN_ABSENT_LAYERS
    }
    return sorted(
        name
        for name, value in vars(module).items()
        if isinstance(value, type) and value in absent
    )


GATE_CLASS = "GateLinear"


def family_patch(module_path: str, name: str, why: str) -> Patch:
    """A declared swap of class ``name`` (or ``Class.attr``) in one of a
    family's vLLM modules."""
    return Patch(
        target=f"{module_path}:{name}",
        expected_params=None,  # the stand-ins take any arguments
        reason=why,
        removal="when vLLM models accept per-module factories",
    )


@dataclass
class Recorded:
    """Prefixes the stand-ins saw while the model was built."""

    dense_mlps: list[str] = field(default_factory=list)


def _dense_factory(native: type, afd: AFDConfig, recorded: Recorded) -> type:
    """A class to put in place of the family's dense-MLP class.

    At a decoder layer's own MLP it records the prefix and builds what this
    role holds there; nested inside an MoE block (shared experts) it builds
    the native MLP on the FFN role and nothing on attention.
    """
    remote = remote_dense_class(native)

    class DenseOrShared:
        def __new__(cls, *args: Any, prefix: str = "", **kwargs: Any) -> Any:
            dense = is_decoder_mlp(prefix)
            if dense:
                recorded.dense_mlps.append(prefix)
            dense_here = afd.is_ffn != afd.compute_gate_on_attention
            if (dense and dense_here) or (not dense and afd.is_ffn):
                return native(*args, prefix=prefix, **kwargs)
            if dense and afd.is_attention:
                return remote(*args, prefix=prefix, **kwargs)
            return Absent()

    return DenseOrShared


def patches_for(
    afd: AFDConfig, family: Family, recorded: Recorded
) -> list[tuple[Patch, Any]]:
    """Every (patch, replacement) this role applies while its model is built."""
    module = importlib.import_module(family.module_path)
    out: list[tuple[Patch, Any]] = []
    if afd.is_attention:
        out.append((RUNNER, AFDRemoteRunner))
        out.append((ROUTED_EXPERTS, AbsentRoutedExperts))
        out.append((MOE_CONFIG, any_width_moe_config(check_patch(MOE_CONFIG))))
    else:
        for name in family.attention:
            if _has(module, name):
                why = f"FFN role: no {name} (the attention role's)"
                out.append((family_patch(family.module_path, name, why), Absent))
        # the generic layers in every module that builds part of the model
        # (Llama 4's embedding, final norm and lm_head are built in llama.py)
        for path, _ in family.builders:
            for name in ffn_absent_names(importlib.import_module(path)):
                why = f"FFN role: no {name} (the attention role's)"
                out.append((family_patch(path, name, why), Absent))
    gate_here = afd.is_ffn != afd.compute_gate_on_attention
    for path, dense_mlp in family.builders:
        builder = importlib.import_module(path)
        if not gate_here and hasattr(builder, GATE_CLASS):
            why = "no router gate where the other role routes"
            out.append((family_patch(path, GATE_CLASS, why), AbsentGate))
        if dense_mlp is not None:
            native = getattr(builder, dense_mlp)
            why = "build each dense MLP / shared expert on the role that runs it"
            factory = _dense_factory(native, afd, recorded)
            out.append((family_patch(path, dense_mlp, why), factory))
    return out


def _has(module: Any, dotted: str) -> bool:
    """Whether ``module`` holds ``Name`` or ``Class.attr``."""
    owner = module
    for part in dotted.split("."):
        if not hasattr(owner, part):
            return False
        owner = getattr(owner, part)
    return True


@contextlib.contextmanager
def role_construction(afd: AFDConfig, family: Family) -> Iterator[Recorded]:
    """Apply this role's patches while the native ``__init__`` runs; every
    original is restored on exit, errors included."""
    recorded = Recorded()
    with contextlib.ExitStack() as stack:
        for patch, replacement in patches_for(afd, family, recorded):
            stack.enter_context(scoped_patch(patch, replacement))
        yield recorded
