"""The async connector's attention ranks as independent data-parallel
engines (``compat.independent_ranks``): which roles, the mark vLLM reads,
the rank an independent engine takes, and the expert count restored while
vLLM builds its process groups. End to end: tests/e2e/test_families.py
(GLM-4.5 2A2F on ``async``: an idle rank takes no step)."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_afd.compat import independent_ranks
from vllm_afd.config import parse_afd_config


def _afd(role: str, connector: str, ranks: int):
    keys = {"role": role, "connector": connector, "num_attention_ranks": ranks}
    if role == "ffn":
        keys["rank"] = 0
    return parse_afd_config(keys)


def test_only_the_async_attention_role_with_several_ranks_runs_independent():
    assert independent_ranks.applies(_afd("attention", "async", 2))
    assert not independent_ranks.applies(_afd("attention", "async", 1))
    assert not independent_ranks.applies(_afd("attention", "p2p", 2))
    assert not independent_ranks.applies(_afd("ffn", "async", 2))


def test_an_independent_engine_keeps_its_rank_as_the_data_parallel_index():
    afd = _afd("attention", "async", 2)
    # the API server: vLLM's data-parallel settings as given
    server = SimpleNamespace(
        data_parallel_rank=0, data_parallel_size=2, data_parallel_index=0
    )
    assert independent_ranks.data_parallel_place(server, afd) == (0, 2)
    # engine 1 after vLLM's reconfigure_for_independent_dp_rank
    engine = SimpleNamespace(
        data_parallel_rank=0, data_parallel_size=1, data_parallel_index=1
    )
    assert independent_ranks.data_parallel_place(engine, afd) == (1, 2)
    p2p = _afd("attention", "p2p", 2)
    lockstep = SimpleNamespace(
        data_parallel_rank=1, data_parallel_size=2, data_parallel_index=1
    )
    assert independent_ranks.data_parallel_place(lockstep, p2p) == (1, 2)


def test_the_mark_hides_the_experts_but_not_from_the_process_groups(monkeypatch):
    """vLLM's ``is_moe`` reads the architecture config's expert count; while
    it builds its process groups the count is back (the attention role's MoE
    blocks ask for the expert-parallel group)."""
    import vllm.config

    arch = SimpleNamespace(num_experts=8)
    current = SimpleNamespace(model_config=SimpleNamespace(model_arch_config=arch))
    independent_ranks.mark(current.model_config)
    assert arch.num_experts == 0
    seen = []
    wrapped = independent_ranks._with_experts_counted(
        lambda *a, **k: (
            seen.append(current.model_config.model_arch_config.num_experts) or "groups"
        )
    )
    monkeypatch.setattr(vllm.config, "get_current_vllm_config", lambda: current)
    assert wrapped(1, 1) == "groups" and seen == [8] and arch.num_experts == 0
    # an unmarked config is vLLM's as it is
    current.model_config = SimpleNamespace(
        model_arch_config=SimpleNamespace(num_experts=4)
    )
    assert wrapped() == "groups" and seen == [8, 4]
