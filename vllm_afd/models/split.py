"""The role-split model: any supported MoE family, one mechanism.

vLLM resolves an architecture to ``vllm_afd.models.split:AFD<Arch>`` (through
``model_class_overrides``, see ``compat.engine_config``); this module makes
that class on first use: the native class with :class:`RoleSplitMixin` in
front. Its ``__init__`` runs the native one under the role's construction
patches (:mod:`vllm_afd.models.construction`), then reads the split from what
vLLM built (:func:`derive_split`) and checks that the role holds none of the
other role's weights. Module and parameter names stay native; checkpoint
weights are filtered by :func:`vllm_afd.models.ownership.weight_owner` before
the native loader sees them.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import (
    MoERunnerInterface,
)
from vllm.model_executor.models.registry import _VLLM_MODELS

from vllm_afd.config import AFDConfig, afd_config_of
from vllm_afd.connector.payloads import Routing
from vllm_afd.errors import AFDConfigError
from vllm_afd.models.construction import Recorded, role_construction
from vllm_afd.models.exchange import SPLITTING_OP, current_exchange, forward_mode
from vllm_afd.models.families import (
    SUPPORTED_ARCHS,
    Family,
    family_of,
    vllm_module_path,
)
from vllm_afd.models.ffn_layers import FFNLayers
from vllm_afd.models.layout import ModelSplit, model_log_line
from vllm_afd.models.moe_tail import closing_add_fused
from vllm_afd.models.ownership import (
    SplitPrefixes,
    under_any,
    vllm_weight_name,
    weight_owner,
)
from vllm_afd.models.remote import Absent, AbsentGate, AFDRemoteRunner, layer_index
from vllm_afd.roles import AFDRole

logger = init_logger(__name__)

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


def _runners(model: nn.Module) -> dict[str, nn.Module]:
    """MoE runners vLLM built, by prefix (AFD's stand-in on attention)."""
    kinds = (MoERunnerInterface, AFDRemoteRunner)
    return {n: m for n, m in model.named_modules() if isinstance(m, kinds)}


def _parent(prefix: str) -> str:
    return prefix.rsplit(".", 1)[0]


def _built_names(model: nn.Module, prefixes: list[str]) -> tuple[str, ...]:
    """The names in ``model`` of the modules built under ``prefixes``.

    A prefix is the name vLLM passed while building, which is the module's
    name in the model unless the family builds its decoder under another
    prefix than its attribute (Step-3 builds ``model`` under ``""``: its
    layers' prefixes are ``.layers.N``, their modules ``model.layers.N``);
    such a prefix names the one module whose name ends with it.

    Raises:
        AFDConfigError: no module, or several, end with such a prefix.
    """
    names = [n for n, _ in model.named_modules()]
    built = []
    for prefix in prefixes:
        if prefix in names:
            built.append(prefix)
            continue
        tail = "." + prefix.lstrip(".")
        found = [n for n in names if n.endswith(tail)]
        if len(found) != 1:
            raise AFDConfigError(
                f"a dense MLP was built under prefix {prefix!r}, which names "
                f"{len(found)} modules of the model, not one: {found}"
            )
        built.append(found[0])
    return tuple(built)


def _uniform(values: dict[str, Any], what: str) -> Any:
    found = set(values.values())
    if len(found) != 1:
        raise AFDConfigError(f"AFD needs one {what} for every MoE layer; got {values}")
    return found.pop()


def derive_split(
    model: nn.Module,
    arch: str,
    family: Family,
    afd: AFDConfig,
    recorded: Recorded,
    vllm_config: VllmConfig,
) -> ModelSplit:
    """Read the split from the modules vLLM built.

    Raises:
        AFDConfigError: the model has no MoE layer built by vLLM's MoE
            factory, or its MoE layers disagree in width, experts or top-k.
    """
    runners = _runners(model)
    if not runners:
        raise AFDConfigError(
            f"{arch}: vLLM built no MoE layer through its MoE factory "
            "(FusedMoEFactory); AFD splits MoE models only"
        )
    configs = {name: r.moe_config for name, r in runners.items()}
    first = next(iter(runners))
    stack_path = first.split(".")
    stack = ".".join(stack_path[: stack_path.index(str(layer_index(first)))])
    # what holds each runner and its gate: the MoE block, or the decoder
    # layer itself (``layer_holds_moe``: then the block is the runner alone)
    holders = tuple(_parent(name) for name in runners)
    blocks = tuple(runners) if family.layer_holds_moe else holders
    gates = tuple(
        f"{h}.{family.gate}"
        for h in holders
        if getattr(model.get_submodule(h), family.gate, None) is not None
    ) + tuple(f"{h}.{part}" for h in holders for part in family.gate_parts)
    moe_layers = tuple(sorted(layer_index(b) for b in blocks))
    dense_mlps = _built_names(model, recorded.dense_mlps)
    dense_layers = tuple(sorted(layer_index(p) for p in dense_mlps))
    both = sorted(set(moe_layers) & set(dense_layers))
    if both and not afd.compute_gate_on_attention:
        raise AFDConfigError(
            f"{arch}: layers {both} each run a dense MLP beside their MoE block "
            "(the FFN role would get two per layer), so the gate runs on the "
            "attention role, where the dense MLPs then run: set "
            "afd.compute_gate_on_attention to true"
        )
    remote = moe_layers if afd.compute_gate_on_attention else dense_layers + moe_layers
    shared = all(_has_shared_experts(r) for r in runners.values())
    return ModelSplit(
        arch=arch,
        num_layers=len(model.get_submodule(stack)),
        hidden_size=_uniform({n: c.hidden_dim for n, c in configs.items()}, "width"),
        moe_layers=moe_layers,
        dense_layers=dense_layers,
        remote_layers=tuple(sorted(remote)),
        num_experts=_uniform(
            {n: c.num_logical_experts for n, c in configs.items()}, "expert count"
        ),
        top_k=_uniform({n: c.experts_per_token for n, c in configs.items()}, "top-k"),
        shared_experts=shared,
        moe_output_parts=2 if shared and _parts_apart(afd, vllm_config) else 1,
        prefixes=SplitPrefixes(
            moe_blocks=blocks,
            gates=gates,
            dense_mlps=dense_mlps,
            routed_experts=tuple(runners),
        ),
    )


def _parts_apart(afd: AFDConfig, vllm_config: VllmConfig) -> bool:
    """Whether the FFN ships the shared and routed expert outputs apart: when
    plain vLLM adds them unrounded (``moe_tail``), and when several FFN ranks
    each return a part of the routed sum (``async``: the shared experts run
    on one of them)."""
    split_experts = afd.is_async and afd.num_ffn_ranks > 1
    return split_experts or closing_add_fused(vllm_config)


def _has_shared_experts(runner: nn.Module) -> bool:
    if isinstance(runner, AFDRemoteRunner):
        return runner.has_shared_experts
    return runner.shared_experts is not None


def parameter_group(name: str, prefixes: SplitPrefixes) -> str:
    """Which part of the model a parameter belongs to (for per-role bytes)."""
    under = lambda ps: under_any(name, ps)  # noqa: E731
    if under(prefixes.dense_mlps):
        return "dense_mlp"
    if under(prefixes.gates):
        return "gate"
    if under(prefixes.routed_experts):
        return "routed_experts"
    if under(prefixes.moe_blocks):
        return "shared_experts"
    if "lm_head" in name:
        return "lm_head"
    if "embed" in name:  # embed_tokens, gpt-oss's embedding
        return "embed_tokens"
    if "norm" in name and "attn" not in name:
        return "norms"
    return "attention"


class RoleSplitMixin(nn.Module):
    """Put before a native ``…ForCausalLM``: builds only this role's modules.

    Attributes:
        afd: the deployment's AFD config.
        afd_split: the split read from what vLLM built.
        afd_ffn: the FFN role's per-layer compute (None on attention).
    """

    _afd_arch: str = ""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        afd = afd_config_of(vllm_config)
        family = family_of(self._afd_arch)
        assert family is not None, self._afd_arch
        if family.layer_holds_moe and not afd.compute_gate_on_attention:
            raise AFDConfigError(
                f"{self._afd_arch}: its decoder layer holds the router and the "
                "experts itself (no MoE block the FFN role could run), so the "
                "gate runs on the attention role: set "
                "afd.compute_gate_on_attention to true"
            )
        with role_construction(afd, family) as recorded:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.afd = afd
        self.afd_split = derive_split(
            self, self._afd_arch, family, afd, recorded, vllm_config
        )
        splits = vllm_config.compilation_config.splitting_ops or ()
        self._afd_finish_attention(family, splits_graphs=SPLITTING_OP in splits)
        self._afd_drop_unrouted_gate_parameters()
        self._afd_drop_attention_leftovers()
        check_role_weights(self, afd, self.afd_split)
        self.afd_ffn: FFNLayers | None = None
        if afd.is_ffn:
            self.afd_ffn = FFNLayers(self, self.afd_split, afd)
        logger.info(
            "%s",
            model_log_line(afd.role.value, self.afd_split, self.parameter_bytes()),
        )

    def _afd_finish_attention(self, family: Family, splits_graphs: bool) -> None:
        """Attention role: tell each remote runner how it ships (and whether
        its exchange is a splitting op of piecewise graphs), and drop what
        the MoE blocks built for the FFN role outside vLLM's factory (a gate
        of another class, a shared expert's own gate)."""
        if not self.afd.is_attention:
            return
        gate_here = self.afd.compute_gate_on_attention
        for name in self.afd_split.prefixes.routed_experts:
            runner = self.get_submodule(name)
            runner.routes = gate_here
            runner.parts = self.afd_split.moe_output_parts
            runner.splits_graphs = splits_graphs
            if family.layer_holds_moe:
                continue  # its holder is the decoder layer: all attention's
            block = self.get_submodule(_parent(name))
            for child_name, child in list(block.named_children()):
                if child is runner or not any(True for _ in child.parameters()):
                    continue
                if child_name == family.gate:
                    if not gate_here:
                        setattr(block, child_name, AbsentGate())
                    continue
                setattr(block, child_name, Absent())

    def _afd_drop_unrouted_gate_parameters(self) -> None:
        """On the role that does not route: unregister the router parameters
        an MoE block holds itself rather than in a module (EXAONE-MoE's score
        bias, ``gate_parts``), so they are neither loaded nor held as weights
        here. They stay plain tensors of the block: the runner vLLM built
        keeps a reference, and never routes on this role."""
        if self.afd.compute_gate_on_attention == self.afd.is_attention:
            return
        gates = self.afd_split.prefixes.gates
        loose = {
            id(param)
            for name, param in self.named_parameters(remove_duplicate=False)
            if name in gates
        }
        # every module registering one (vLLM's MoE layer holds the bias too)
        for module in self.modules():
            for attr, param in list(module._parameters.items()):
                if param is not None and id(param) in loose:
                    delattr(module, attr)
                    setattr(module, attr, param.data)

    def _afd_drop_attention_leftovers(self) -> None:
        """FFN role: replace by nothing each module that holds weights the
        attention role owns only, outside what the FFN runs, and that the
        family's classes build on both roles (Gemma 4's per-layer embedding
        projections, a router's scales where the gate runs on attention).
        The FFN never calls them: it runs MoE blocks and dense MLPs only."""
        if not self.afd.is_ffn:
            return
        prefixes = self.afd_split.prefixes
        gate_on_attn = self.afd.compute_gate_on_attention

        def attention_owns_all(module: nn.Module, prefix: str) -> bool:
            names = [f"{prefix}.{n}" for n, _ in module.named_parameters()]
            return bool(names) and all(
                weight_owner(n, prefixes, compute_gate_on_attention=gate_on_attn)
                is AFDRole.ATTENTION
                for n in names
            )

        dropped: list[str] = []

        def visit(module: nn.Module, prefix: str) -> None:
            for name, child in list(module.named_children()):
                path = f"{prefix}.{name}" if prefix else name
                if attention_owns_all(child, path):
                    setattr(module, name, Absent())
                    dropped.append(path)
                else:
                    visit(child, path)

        visit(self, "")
        if dropped:
            logger.info(
                "AFD ffn model: not held, the attention role's: %s", ", ".join(dropped)
            )

    def parameter_bytes(self) -> dict[str, int]:
        """Bytes of the parameters this role holds, by :func:`parameter_group`."""
        groups: dict[str, int] = dict.fromkeys(PARAMETER_GROUPS, 0)
        for name, param in self.named_parameters():
            group = parameter_group(name, self.afd_split.prefixes)
            groups[group] += param.numel() * param.element_size()
        return groups

    # ---- attention role -------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if not self.afd.is_attention:
            raise AFDConfigError(
                "the AFD FFN role does not run the decoder forward; it is "
                "driven by the connector"
            )
        current_exchange().begin_forward(
            int(positions.shape[-1]), forward_mode(positions)
        )
        return super().forward(input_ids, positions, *args, **kwargs)

    # ---- FFN role -------------------------------------------------------
    def compute_ffn(
        self, layer_idx: int, hidden: torch.Tensor, routing: Routing | None = None
    ) -> torch.Tensor:
        """Run layer ``layer_idx``'s dense MLP or MoE on ``hidden [T, H]``."""
        assert self.afd_ffn is not None, "compute_ffn runs on the FFN role"
        return self.afd_ffn.compute(layer_idx, hidden, routing)

    def keep_ffn_experts(
        self, lo: int, hi: int, keep_shared: bool = True
    ) -> tuple[int, int]:
        """Keep routed experts ``[lo, hi)`` only (``FFNLayers.keep_experts``)."""
        assert self.afd_ffn is not None, "keep_ffn_experts runs on the FFN role"
        return self.afd_ffn.keep_experts(lo, hi, keep_shared)

    def compile_ffn(self) -> None:
        """``torch.compile`` each remote layer, as vLLM compiles the model."""
        assert self.afd_ffn is not None, "compile_ffn runs on the FFN role"
        self.afd_ffn.compile()

    @property
    def remote_layers(self) -> tuple[int, ...]:
        return self.afd_split.remote_layers

    # ---- both -----------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
        role, split = self.afd.role, self.afd_split
        gate_on_attn = self.afd.compute_gate_on_attention
        # the checkpoint-to-vLLM name map: the model's, or its inner model's
        # (Granite-MoE maps ``router.weight`` to ``gate.weight`` there)
        mapper = getattr(self, "hf_to_vllm_mapper", None) or next(
            (
                m.hf_to_vllm_mapper
                for m in self.children()
                if getattr(m, "hf_to_vllm_mapper", None) is not None
            ),
            None,
        )

        family = family_of(self._afd_arch)
        map_name = mapper._map_name if mapper is not None else None
        renames = family.checkpoint_renames if family is not None else ()

        def vllm_name(name: str) -> str:
            return vllm_weight_name(name, map_name, renames)

        def owner(name: str) -> Any:
            return weight_owner(
                vllm_name(name), split.prefixes, compute_gate_on_attention=gate_on_attn
            )

        sliced = self._afd_take_expert_slice()
        mine: Iterable[tuple[str, torch.Tensor]] = (
            (n, t) for n, t in weights if owner(n) is role
        )
        if sliced and family is not None and family.whole_expert_tensors:
            assert self.afd_ffn is not None

            mine = self.afd_ffn.own_expert_rows(
                mine, lambda n: under_any(vllm_name(n), split.prefixes.routed_experts)
            )
        loaded = super().load_weights(mine)
        if sliced:
            assert self.afd_ffn is not None
            self.afd_ffn.check_slice_loaded()
        return loaded

    def _afd_take_expert_slice(self) -> bool:
        """``async`` FFN rank of several: hold only its own routed experts
        before the weights load (``FFNLayers.take_expert_slice``); whether it
        did."""
        afd = self.afd
        if not (afd.is_ffn and afd.is_async and afd.num_ffn_ranks > 1):
            return False
        from vllm_afd.connector.async_ep import ExpertSlices

        assert self.afd_ffn is not None
        slices = ExpertSlices(self.afd_split.num_experts, afd.num_ffn_ranks)
        self.afd_ffn.take_expert_slice(*slices.bounds(afd.rank or 0))
        return True


def check_role_weights(model: nn.Module, afd: AFDConfig, split: ModelSplit) -> None:
    """A role holds no parameter the other role owns.

    Raises:
        AFDConfigError: naming the first such parameter; the family record
            (or the model's way of building its MoE) does not fit the split.
    """
    gate_on_attn = afd.compute_gate_on_attention
    for name, _ in model.named_parameters():
        owner = weight_owner(
            name, split.prefixes, compute_gate_on_attention=gate_on_attn
        )
        if owner is not afd.role:
            raise AFDConfigError(
                f"{split.arch}: the AFD {afd.role.value} role built {name}, which "
                f"the {owner.value} role owns; the model builds it outside what "
                "the role split replaces (vLLM's MoE factory and the family "
                "record in vllm_afd.models.families)"
            )


_CLASSES: dict[str, type] = {}


def role_split_class(arch: str) -> type:
    """The role-split class of architecture ``arch`` (made once, cached).

    Raises:
        AFDConfigError: no family record serves ``arch``.
    """
    if arch in _CLASSES:
        return _CLASSES[arch]
    if family_of(arch) is None or arch not in _VLLM_MODELS:
        raise AFDConfigError(
            f"AFD does not support architecture {arch!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHS)}"
        )
    module_name, class_name = _VLLM_MODELS[arch]
    native = getattr(
        importlib.import_module(vllm_module_path(module_name)),
        class_name,
    )
    cls = type(
        f"AFD{arch}",
        (RoleSplitMixin, native),
        {"_afd_arch": arch, "__module__": __name__, "__qualname__": f"AFD{arch}"},
    )
    _CLASSES[arch] = cls
    return cls


def class_name(arch: str) -> str:
    """The qualified name vLLM imports for ``arch`` (``model_class_overrides``)."""
    return f"{__name__}:AFD{arch}"


def __getattr__(name: str) -> type:
    if name.startswith("AFD") and family_of(name[3:]) is not None:
        return role_split_class(name[3:])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
