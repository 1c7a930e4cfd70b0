"""The ``async`` connector's attention role in piecewise CUDA graphs.

Its exchange sends each work item's header from the host, so no graph may
hold it: it is a splitting op of vLLM's piecewise graphs
(``exchange.SPLITTING_OP``), run eagerly between two graphs and writing into
a tensor the graph before it allocated. Checked here on CPU: the config
(``compat.engine_config.split_at_exchange``), and vLLM's own split of a
Dynamo-traced forward around the op (the op alone in its piece, the output
allocated before it, the split forward computing what the eager one does).
tests/gpu/test_async_gpu.py serves it in CUDA graphs against plain vLLM.
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.compilation.backends import split_graph  # noqa: E402
from vllm.compilation.partition_rules import should_split  # noqa: E402
from vllm.config import CompilationConfig, CUDAGraphMode  # noqa: E402

from vllm_afd.compat.engine_config import split_at_exchange  # noqa: E402
from vllm_afd.errors import AFDConfigError  # noqa: E402
from vllm_afd.models.exchange import (  # noqa: E402
    SPLITTING_OP,
    ffn_exchange_routed_out,
    install_exchange,
)

ATTENTION_OPS = ["vllm::unified_attention_with_output"]


def _config(mode: CUDAGraphMode, splitting_ops: list[str]) -> CompilationConfig:
    return CompilationConfig(cudagraph_mode=mode, splitting_ops=list(splitting_ops))


def test_piecewise_graphs_split_at_the_exchange() -> None:
    config = _config(CUDAGraphMode.PIECEWISE, ATTENTION_OPS)
    split_at_exchange(config)
    split_at_exchange(config)  # once only
    assert config.splitting_ops == [*ATTENTION_OPS, SPLITTING_OP]
    assert config.cudagraph_mode == CUDAGraphMode.PIECEWISE


def test_vllms_default_graphs_become_piecewise(caplog) -> None:
    config = _config(CUDAGraphMode.FULL_AND_PIECEWISE, ATTENTION_OPS)
    with caplog.at_level(logging.WARNING, logger="vllm_afd"):
        split_at_exchange(config)
    assert config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert SPLITTING_OP in config.splitting_ops
    assert "FULL_AND_PIECEWISE -> PIECEWISE" in caplog.text


def test_eager_is_left_alone() -> None:
    config = _config(CUDAGraphMode.NONE, ATTENTION_OPS)
    split_at_exchange(config)
    assert config.splitting_ops == ATTENTION_OPS


@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY])
def test_full_graphs_are_refused_naming_what_works(mode: CUDAGraphMode) -> None:
    with pytest.raises(AFDConfigError, match=f"cudagraph_mode is {mode.name}") as e:
        split_at_exchange(_config(mode, ATTENTION_OPS))
    assert '"cudagraph_mode": "PIECEWISE"' in str(e.value)
    assert "--enforce-eager" in str(e.value)


def test_piecewise_without_splitting_ops_is_refused() -> None:
    with pytest.raises(AFDConfigError, match="splitting ops"):
        split_at_exchange(_config(CUDAGraphMode.PIECEWISE, []))


class _Doubling:
    """An exchange whose FFN answers 2 * hidden + the routing's weights'
    sum per row (the op's contract only: hidden in, [T, parts * H] out)."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def exchange(self, hidden, layer_idx, routing=None, parts=1):
        self.calls.append(layer_idx)
        out = 2 * hidden + routing.topk_weights.sum(-1, keepdim=True)
        return out.repeat(1, parts)


@pytest.fixture
def doubling():
    exchange = _Doubling()
    install_exchange(exchange)  # type: ignore[arg-type]
    yield exchange
    install_exchange(None)


def _layer(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """A decoder layer's MoE half: the gate before the exchange, the
    residual add after it."""
    h = torch.relu(x) * 3
    weights, ids = torch.topk(torch.softmax(h @ gate, -1), 2)
    return ffn_exchange_routed_out(h, weights, ids, 5, 2) + x.repeat(1, 2)


def test_the_op_fills_the_tensor_it_is_given(doubling) -> None:
    x, gate = torch.randn(4, 8), torch.randn(8, 6)
    h = torch.relu(x) * 3
    weights, ids = torch.topk(torch.softmax(h @ gate, -1), 2)
    expected = (2 * h + weights.sum(-1, keepdim=True)).repeat(1, 2) + x.repeat(1, 2)
    torch.testing.assert_close(_layer(x, gate), expected)
    assert doubling.calls == [5]


def test_vllm_splits_a_traced_forward_at_the_exchange(doubling) -> None:
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    x, gate = torch.randn(5, 8), torch.randn(8, 6)
    compiled = torch.compile(_layer, backend=keep, fullgraph=True, dynamic=False)
    expected = _layer(x, gate)
    torch.testing.assert_close(compiled(x, gate), expected)
    (traced,) = graphs

    split, pieces = split_graph(traced, [SPLITTING_OP])
    kinds = [piece.is_splitting_graph for piece in pieces]
    assert kinds == [False, True, False], kinds
    (op_piece,) = [p.graph for p in pieces if p.is_splitting_graph]
    ops = [n for n in op_piece.graph.nodes if n.op == "call_function"]
    assert len(ops) == 1 and should_split(ops[0], [SPLITTING_OP]), ops
    before = [str(n.target) for n in pieces[0].graph.graph.nodes]
    assert "new_empty" in before  # its output comes from the graph before it

    doubling.calls.clear()
    (out,) = split(x, gate)  # a Dynamo graph returns a tuple
    torch.testing.assert_close(out, expected)
    assert doubling.calls == [5]
