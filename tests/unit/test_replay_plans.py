"""Plans around CUDA graphs. A FULL graph replay never runs the model's
forward, so the attention runner's graph manager sends the REPLAY plan itself,
just before replaying. A forward that records or replays vLLM's piecewise
graphs (which hold the exchanges) sends CAPTURE or REPLAY itself.

Driven on CPU with the loopback connector and a graph manager that records
what it replays (the real one needs CUDA; tests/gpu covers it end to end).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm_afd.config import parse_afd_config  # noqa: E402
from vllm_afd.connector import ExecMode, Fingerprint, create_connector  # noqa: E402
from vllm_afd.models.exchange import AttentionExchange, install_exchange  # noqa: E402
from vllm_afd.worker.attention_side import announce_graphs  # noqa: E402


class _Manager:
    """The part of vLLM's CudaGraphManager the runner calls."""

    def __init__(self, forward=None) -> None:
        self.replayed: list[int] = []
        self.forward = forward

    def capture(self, create_forward_fn, progress_bar_desc="Capturing"):
        return self.forward()

    def run_fullgraph(self, desc):
        self.replayed.append(desc.num_tokens)
        return f"hidden[{desc.num_tokens}]"


@pytest.fixture
def endpoints():
    fp = Fingerprint(
        arch="TinyMoE", hidden_size=8, dtype="float32", num_layers=2,
        moe_layers=(1,), num_experts=4, top_k=2, num_attention_ranks=1,
        num_ffn_ranks=1, compute_gate_on_attention=False, connector="loopback",
    )  # fmt: skip

    def make(role: str):
        cfg = parse_afd_config({"role": role, "connector": "loopback", "port": 43111})
        return create_connector(cfg, 0, fp, "cpu")

    ffn, att = make("ffn"), make("attention")
    threads = [threading.Thread(target=c.start) for c in (ffn, att)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    install_exchange(AttentionExchange(att))
    yield ffn, att
    install_exchange(None)
    att.close()
    ffn.close()


def test_replay_sends_a_replay_plan_of_the_graph_size_first(endpoints):
    ffn, att = endpoints
    manager = _Manager()
    announce_graphs(manager)
    out = manager.run_fullgraph(SimpleNamespace(num_tokens=16, num_ubatches=1))
    assert out == "hidden[16]" and manager.replayed == [16]
    plan = ffn.recv_plan()
    assert plan.mode is ExecMode.REPLAY and plan.ubatch_tokens == (16,)
    # The replayed exchanges never reach Python: their bytes come from the
    # plan (2 layers x 16 tokens x 8 fp32 values, each way).
    assert att.stats.a2f_bytes == att.stats.f2a_bytes == 2 * 16 * 8 * 4


@pytest.mark.parametrize("num_tokens,split", [(16, (8, 8)), (15, (7, 8))])
def test_micro_batched_replay_plans_each_micro_batch(endpoints, num_tokens, split):
    ffn, _ = endpoints
    manager = _Manager()
    announce_graphs(manager)
    manager.run_fullgraph(SimpleNamespace(num_tokens=num_tokens, num_ubatches=2))
    plan = ffn.recv_plan()
    assert plan.mode is ExecMode.REPLAY and plan.ubatch_tokens == split


def test_capture_marks_the_exchange_while_it_records(endpoints):
    from vllm_afd.models.exchange import current_exchange

    seen = []
    manager = _Manager(lambda: seen.append(current_exchange().capturing_graphs))
    announce_graphs(manager)
    manager.capture(None)
    assert seen == [True] and current_exchange().capturing_graphs is False

    def fails():
        raise RuntimeError("capture failed")

    manager.forward = fails
    with pytest.raises(RuntimeError, match="capture failed"):
        manager.capture(None)
    assert current_exchange().capturing_graphs is False


@pytest.mark.parametrize(
    "runtime_mode,metadata,capturing,expected",
    [
        ("PIECEWISE", {}, True, ExecMode.CAPTURE),
        ("PIECEWISE", {}, False, ExecMode.REPLAY),
        ("NONE", {}, True, ExecMode.WARMUP),  # a warm-up run before a capture
        ("NONE", {}, False, ExecMode.EAGER),
        ("NONE", None, False, ExecMode.WARMUP),
    ],
)
def test_forward_mode_follows_vllms_graph_mode(
    endpoints, runtime_mode, metadata, capturing, expected
):
    import torch
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import ForwardContext, override_forward_context

    from vllm_afd.models.exchange import current_exchange, forward_mode

    context = ForwardContext(
        no_compile_layers={},
        attn_metadata=metadata,
        slot_mapping={},
        cudagraph_runtime_mode=CUDAGraphMode[runtime_mode],
    )
    current_exchange().capturing_graphs = capturing
    with override_forward_context(context):
        assert forward_mode(torch.zeros(4, dtype=torch.long)) is expected
