"""The FFN role's per-layer compute, over the native modules vLLM built.

Wraps vllm/model_executor/layers/fused_moe/runner/moe_runner.py @ 0.32.0 (the
router's ``select_experts`` on the routing-shipped path)::

    layer kind        gate on FFN (default)         gate on attention
    dense MLP         mlp(hidden)                   (runs on attention)
    MoE               block(hidden): the family's   runner(hidden) with the
                      own gate, router, experts     shipped (w, ids) in place
                      and shared experts            of its router

Running the whole MoE block on the FFN role is what makes "gate on FFN" work
for every family, whether its router runs inside vLLM's MoE runner (DeepSeek,
Qwen3-MoE) or before it (Mixtral, Qwen2-MoE, GLM-4.5). With the shared and
routed outputs shipped apart (``moe_output_parts == 2``) each MoE layer goes
through :class:`~vllm_afd.models.moe_tail.MoEOutputParts`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from vllm_afd.compat.patching import Patch, check_patch
from vllm_afd.config import AFDConfig
from vllm_afd.connector.payloads import Routing
from vllm_afd.errors import AFDConfigError
from vllm_afd.models.families import family_of
from vllm_afd.models.layout import ModelSplit
from vllm_afd.models.moe_tail import MoEOutputParts
from vllm_afd.models.remote import layer_index

LayerFn = Callable[[torch.Tensor], torch.Tensor]

SELECT_EXPERTS = Patch(
    target="vllm.model_executor.layers.fused_moe.router.fused_moe_router:"
    "FusedMoERouter.select_experts",
    expected_params=(
        "self",
        "hidden_states",
        "router_logits",
        "topk_indices_dtype",
        "input_ids",
    ),
    reason="FFN role with the gate on attention: each MoE runner's router "
    "(one instance attribute per layer) serves the routing shipped from "
    "attention",
    removal="when vLLM's MoE runner accepts precomputed top-k weights and ids",
)


class ShippedRouting:
    """Serves the routing shipped from attention to one native MoE runner.

    Installed as the runner's router ``select_experts``; :meth:`use` sets the
    routing of the next call.
    """

    def __init__(self, router: Any) -> None:
        check_patch(SELECT_EXPERTS)
        self.router = router
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        router.select_experts = self

    def use(self, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
        self.pending = (topk_weights, topk_ids)

    def __call__(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        topk_indices_dtype: torch.dtype | None = None,
        *,
        input_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pending is None:
            raise RuntimeError("AFD FFN MoE ran without the routing from attention")
        topk_weights, topk_ids = self.pending
        self.pending = None
        if topk_indices_dtype is not None:
            topk_ids = topk_ids.to(topk_indices_dtype)
        return topk_weights, topk_ids


SHARED_LAYER = Patch(
    target="vllm.model_executor.layers.fused_moe.runner.shared_experts:"
    "SharedExperts.__init__",
    expected_params=(
        "self",
        "layer",
        "moe_config",
        "enable_dbo",
        "mk_can_overlap_shared_experts",
    ),
    reason="FFN ranks other than 0 on the async connector: the shared experts "
    "(the module each runner's SharedExperts keeps as _layer) return zeros, "
    "as FFN rank 0 runs them",
    removal="when an MoE runner can be built or run without its shared experts",
)


def _check_routable(name: str, runner: Any) -> None:
    """Routing computed on attention must reach the runner's experts.

    Raises:
        AFDConfigError: the runner's kernel routes inside itself, or its
            router computes more than top-k weights and ids.
    """
    from vllm.model_executor.layers.fused_moe.router.zero_expert_router import (
        ZeroExpertRouter,
    )

    if runner.is_monolithic:
        raise AFDConfigError(
            f"{name}: this MoE kernel routes inside itself (monolithic), so "
            "afd.compute_gate_on_attention=true cannot hand it the routing; "
            "set it to false"
        )
    if (
        isinstance(runner.router, ZeroExpertRouter)
        or runner.moe_config.has_hash_routing
    ):
        raise AFDConfigError(
            f"{name}: the router needs more than top-k weights and ids (zero "
            "experts or hash routing); set afd.compute_gate_on_attention=false"
        )


def _slice_map(lo: int, hi: int) -> Callable[[int], int]:
    """vLLM's global-to-local expert id map for experts ``[lo, hi)``; -1 (not
    on this rank: the loader skips it) for the others."""

    def local(expert_id: int) -> int:
        return expert_id - lo if lo <= expert_id < hi else -1

    return local


#: weight dtypes of unquantized experts
_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the routed-expert parameters an expert slice cuts, one row per expert
#: (gpt-oss's experts carry biases)
_PER_EXPERT = {"w13_weight", "w2_weight", "w13_bias", "w2_bias"}


def _sliceable_params(idx: int, experts: nn.Module) -> dict[str, nn.Parameter]:
    """Layer ``idx``'s routed-expert parameters, each one row per expert.

    Raises:
        AFDConfigError: they are quantized, or hold more than
            ``w13_weight``, ``w2_weight`` and their biases (quantization
            scales), which an expert slice does not know how to cut.
    """
    params = dict(experts.named_parameters(recurse=False))
    extra = sorted(set(params) - _PER_EXPERT)
    w13 = params.get("w13_weight")
    quantized = any("scale" in name for name in extra) or (
        w13 is not None and w13.dtype not in _ACTIVATION_DTYPES
    )
    if not extra and not quantized:
        return params
    what = []
    if quantized:
        method = type(getattr(experts, "quant_method", None)).__name__
        what.append(f"are quantized ({method})")
    if extra:
        what.append(f"hold {', '.join(extra)} besides their weights and biases")
    raise AFDConfigError(
        f"layer {idx}: the routed experts {' and '.join(what)}; splitting "
        "their experts over FFN ranks (afd.connector='async') is not supported"
    )


class FFNLayers:
    """Layer index -> the computation the FFN role runs for it."""

    def __init__(self, model: nn.Module, split: ModelSplit, afd: AFDConfig) -> None:
        self.split = split
        self.shipped: dict[int, ShippedRouting] = {}
        self.runners: dict[int, Any] = {}
        #: the first expert this rank holds (``keep_experts``): shipped ids
        #: are global, the kernel's local
        self.first_expert = 0
        #: the routed experts ``[lo, hi)`` taken before the weights loaded
        #: (``take_expert_slice``), or None: all of them
        self.expert_slice: tuple[int, int] | None = None
        self.layers: dict[int, LayerFn] = {}
        self.compiled: dict[int, LayerFn] = {}
        gate_on_attn = afd.compute_gate_on_attention
        family = family_of(split.arch)
        tail = family is not None and family.block_tail
        for name in split.prefixes.routed_experts:
            runner = model.get_submodule(name)
            idx = layer_index(name)
            self.runners[idx] = runner
            if gate_on_attn:
                _check_routable(name, runner)
                self.shipped[idx] = ShippedRouting(runner.router)
                fn: LayerFn = _runner_call(runner)
            else:
                fn = model.get_submodule(name.rsplit(".", 1)[0])
                if tail:
                    fn = _runner_output_in(fn, runner)
            if split.moe_output_parts == 2:
                fn = MoEOutputParts(fn, runner).forward
            self.layers[idx] = fn
        if not gate_on_attn:
            for prefix in split.prefixes.dense_mlps:
                self.layers[layer_index(prefix)] = model.get_submodule(prefix)

    def compute(
        self, layer_idx: int, hidden: torch.Tensor, routing: Routing | None
    ) -> torch.Tensor:
        """Layer ``layer_idx`` on ``hidden [T, H]``; with the routing shipped
        from attention (``topk_weights``/``topk_ids [T, K]``) for MoE layers
        when the gate runs there. MoE layers return ``[T, parts * H]``."""
        if routing is not None:
            ids = routing.topk_ids
            if self.first_expert:
                ids = ids - self.first_expert
            self.shipped[layer_idx].use(routing.topk_weights, ids)
        fn = self.compiled.get(layer_idx)
        if fn is None:
            fn = self.layers[layer_idx]
        return fn(hidden)

    def take_expert_slice(self, lo: int, hi: int) -> None:
        """Before the weights load: hold routed experts ``[lo, hi)`` only
        (the ``async`` connector's expert slice of this FFN rank).

        Each MoE layer's expert parameters shrink to ``hi - lo`` experts
        (filled with NaN until loaded: :meth:`check_slice_loaded`), and
        vLLM's weight loader maps the checkpoint's global expert ids into the
        slice and skips the others, as it does for its own expert
        parallelism; so the other experts are never copied into memory. The
        kernel then indexes the slice ``0..hi-lo-1`` and :meth:`compute`
        shifts the shipped ids.

        Raises:
            AFDConfigError: a layer's experts hold more than ``w13_weight``
                and ``w2_weight`` per expert (biases, quantization scales),
                which this slicing does not know how to cut.
        """
        for idx, runner in self.runners.items():
            experts = runner.routed_experts
            params = _sliceable_params(idx, experts)
            for param in params.values():
                # in place: vLLM's weight_loader &c. stay, and so does any
                # reference vLLM keeps to the parameter (its MoE quant config
                # holds the bias parameters it feeds the CPU kernel)
                param.data = param.data.new_full(
                    (hi - lo, *param.shape[1:]), float("nan")
                )
            experts._map_global_expert_id_to_local_expert_id = _slice_map(lo, hi)
        self.expert_slice = (lo, hi)
        self.first_expert = lo

    def own_expert_rows(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        holds_every_expert: Callable[[str], bool],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's ``weights`` with each tensor of every expert (a
        name ``holds_every_expert`` accepts: ``[E, ...]``) cut to this rank's
        slice, for a loader that copies such tensors whole
        (``Family.whole_expert_tensors``); after :meth:`take_expert_slice`.

        Raises:
            AFDConfigError: such a tensor's first dimension is not the
                model's expert count.
        """
        assert self.expert_slice is not None, "take_expert_slice comes first"
        lo, hi = self.expert_slice
        for name, tensor in weights:
            if holds_every_expert(name):
                if tensor.shape[0] != self.split.num_experts:
                    raise AFDConfigError(
                        f"{name} has {tensor.shape[0]} rows where the model's "
                        f"{self.split.num_experts} experts were expected; "
                        "afd.connector='async' with several FFN ranks cannot "
                        "split this checkpoint's experts"
                    )
                tensor = tensor[lo:hi]
            yield name, tensor

    def check_slice_loaded(self) -> None:
        """After the weights load: every expert of the slice was loaded.

        Raises:
            AFDConfigError: a layer's expert weights still hold the NaN
                :meth:`take_expert_slice` filled them with: the model's
                loader wrote its experts past vLLM's expert-id mapping.
        """
        for idx, runner in self.runners.items():
            for name, param in runner.routed_experts.named_parameters(recurse=False):
                if torch.isnan(param.data).any():
                    raise AFDConfigError(
                        f"layer {idx}: {name} of this FFN rank's expert slice "
                        "was not loaded (the model loads its experts past "
                        "vLLM's expert-id mapping); afd.connector='async' "
                        "with several FFN ranks cannot split this model's experts"
                    )

    def keep_experts(
        self, lo: int, hi: int, keep_shared: bool = True
    ) -> tuple[int, int]:
        """Keep the weights of routed experts ``[lo, hi)`` only (the ``async``
        connector's expert slice of this FFN rank): the slice
        :meth:`take_expert_slice` took before the weights loaded, else cut
        now from all the loaded experts. Without ``keep_shared`` the shared
        experts go too: they return zeros (another FFN rank runs them; the
        attention rank reads its output).

        Returns:
            Bytes of routed-expert weights (kept, of all experts).

        Raises:
            AFDConfigError: a layer's experts hold more than ``w13_weight``
                and ``w2_weight`` per expert (biases, quantization scales),
                which this slicing does not know how to cut; or the slice
                taken at load is another.
        """
        taken = self.expert_slice
        if taken is not None and taken != (lo, hi):
            raise AFDConfigError(
                f"routed experts {lo}..{hi - 1} asked for, but this rank "
                f"loaded {taken[0]}..{taken[1] - 1}"
            )
        kept = before = 0
        total = self.split.num_experts
        for idx, runner in self.runners.items():
            experts = runner.routed_experts
            params = _sliceable_params(idx, experts)
            for param in params.values():
                before += param.numel() * param.element_size() * total // len(param)
                if taken is None:
                    param.data = param.data[lo:hi].clone()  # in place, as above
                kept += param.numel() * param.element_size()
            shared = runner.shared_experts
            if not keep_shared and shared is not None:
                check_patch(SHARED_LAYER)
                for param in shared._layer.parameters():  # the block's too
                    param.data = param.data.new_empty(0)
                shared._layer = _NoSharedExperts()
        self.first_expert = lo
        return kept, before

    def compile(self) -> None:
        """``torch.compile`` each remote layer, as vLLM compiles the model.

        When the attention role runs compiled, plain vLLM fuses the element-wise
        tail of each MoE in one compiled kernel; the FFN role compiles the same
        code to stay exact in bf16. Called before the FFN loop starts.
        """
        import torch._dynamo

        limit = 4 * len(self.layers) + 8
        config = torch._dynamo.config
        config.cache_size_limit = max(config.cache_size_limit, limit)
        config.accumulated_cache_size_limit = max(
            config.accumulated_cache_size_limit, 4 * limit
        )
        self.compiled = {
            i: torch.compile(fn, dynamic=True) for i, fn in self.layers.items()
        }


class _NoSharedExperts(nn.Module):
    """Stands in for the shared experts on an FFN rank that does not run
    them (``keep_experts``): zeros, no weights."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(hidden)


def _runner_output_in(block: nn.Module, runner: Any) -> LayerFn:
    """The MoE block on ``hidden``, returning what its MoE layer returned
    inside it: the block's own steps after that (a ``block_tail`` family's)
    run on attention, which runs the native block around what it receives."""
    native = runner.forward
    out: list[torch.Tensor] = []

    def capture(*args: Any, **kwargs: Any) -> torch.Tensor:
        result = native(*args, **kwargs)
        out.append(result)
        return result

    runner.forward = capture

    def run(hidden: torch.Tensor) -> torch.Tensor:
        block(hidden)
        return out.pop()

    return run


def _runner_call(runner: Any) -> LayerFn:
    """The runner on ``hidden`` alone: its router reads the shipped routing
    and ignores the logits (the runner-held gate is a stand-in here)."""

    def run(hidden: torch.Tensor) -> torch.Tensor:
        return runner(hidden_states=hidden, router_logits=hidden)

    return run
