"""``vllm-afd plan --routing balanced`` relies on vLLM's routing simulation:
with ``VLLM_MOE_ROUTING_SIMULATION_STRATEGY=uniform_random`` vLLM's MoE router
factory (which builds the router of every family) returns a router that picks
top-k distinct experts uniformly at random. Checked against the installed
vLLM, so a vLLM that drops or renames the strategy fails here."""

from __future__ import annotations

import torch

from vllm_afd.cli import plan as plan_cli


def test_balanced_routing_loads_every_expert_evenly(monkeypatch) -> None:
    from vllm.model_executor.layers.fused_moe.router.router_factory import (
        create_fused_moe_router,
    )
    from vllm.model_executor.layers.fused_moe.router.routing_simulator_router import (
        RoutingSimulatorRouter,
    )

    monkeypatch.setenv(plan_cli.ROUTING_ENV, plan_cli.BALANCED)
    router = create_fused_moe_router(top_k=2, global_num_experts=8)
    assert isinstance(router, RoutingSimulatorRouter)
    tokens = 4000
    hidden = torch.zeros(tokens, 16)
    logits = torch.zeros(tokens, 8)
    logits[:, 0] = 100.0  # the model's router would pick expert 0 every time
    _, ids = router._compute_routing(hidden, logits, torch.int32)
    assert ids.shape == (tokens, 2)
    assert bool((ids[:, 0] != ids[:, 1]).all())  # top-k distinct per token
    counts = torch.bincount(ids.flatten().long(), minlength=8)
    assert int(counts.min()) > 0.8 * 2 * tokens / 8  # about 1000 each
