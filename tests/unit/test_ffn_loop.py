"""The FFN daemon loop over the in-process loopback connector (no vLLM)."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from vllm_afd.config import parse_afd_config
from vllm_afd.connector import ExecMode, Fingerprint, StepPlan, create_connector
from vllm_afd.errors import AFDPeerError, AFDPeerStopped
from vllm_afd.worker.ffn_loop import FFNLoop, describe_plan
from vllm_afd.worker.stall_watch import StallWatch

HIDDEN = 8
LAYERS = (0, 1, 2)
_ports = itertools.count(41000)


def _pair(num_attention: int = 1, timeout_s: float = 5.0):
    port = next(_ports)
    fp = Fingerprint(
        arch="TinyMoE", hidden_size=HIDDEN, dtype="float32", num_layers=len(LAYERS),
        moe_layers=LAYERS, num_experts=4, top_k=2,
        num_attention_ranks=num_attention, num_ffn_ranks=1,
        compute_gate_on_attention=False, connector="loopback",
    )  # fmt: skip

    def make(role: str, rank: int):
        cfg = parse_afd_config(
            {
                "role": role, "connector": "loopback", "port": port,
                "num_attention_ranks": num_attention,
                "connector_extra_config": {"timeout_s": timeout_s},
            }
        )  # fmt: skip
        return create_connector(cfg, rank, fp, "cpu")

    return make("ffn", 0), [make("attention", r) for r in range(num_attention)]


def _start_all(*connectors) -> None:
    threads = [threading.Thread(target=c.start) for c in connectors]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)


def _compute(layer_idx: int, batch) -> torch.Tensor:
    return batch.hidden * 2 + layer_idx


def _attention_steps(conn, steps: int, tokens: int, seed: int) -> list[bool]:
    ok = []
    gen = torch.Generator().manual_seed(seed)
    for step in range(1, steps + 1):
        conn.send_plan(StepPlan(step, ExecMode.EAGER, (tokens,)))
        for layer in LAYERS:
            hidden = torch.randn(tokens, HIDDEN, generator=gen)
            conn.send_a2f(layer, 0, hidden)
            out = conn.recv_f2a(layer, 0)
            ok.append(torch.equal(out, hidden * 2 + layer))
    return ok


def test_ffn_loop_serves_merged_peers_exactly_and_ends_on_shutdown() -> None:
    ffn, attns = _pair(num_attention=2)
    _start_all(ffn, *attns)
    exits: list[BaseException | None] = []
    loop = FFNLoop(ffn, _compute, LAYERS, on_exit=exits.append)
    loop.start()
    results: dict[int, list[bool]] = {}
    workers = [
        threading.Thread(
            target=lambda r=r: results.__setitem__(
                r, _attention_steps(attns[r], steps=4, tokens=3 + r, seed=r)
            )
        )
        for r in range(2)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(20)
    for conn in attns:
        conn.close()
    loop._thread.join(10)
    assert all(all(v) for v in results.values()) and len(results) == 2
    assert exits == [None] and loop.error is None
    assert loop.stats.steps == 4
    assert loop.stats.tokens == 4 * (3 + 4)
    assert loop.stats.last_batch_tokens == 7


@pytest.mark.parametrize(
    "raised",
    [
        RuntimeError("expert kernel exploded"),
        AFDPeerStopped("attention rank 0 shut down (closed) while waiting"),
    ],
    ids=["compute-error", "peer-stopped"],
)
def test_what_ends_a_step_is_kept_unless_a_peer_stopped(raised) -> None:
    """An error inside a step is kept and handed to ``on_exit``; a served
    attention rank that shut down for good inside a step (its deployment was
    stopped while it served) ends the loop as a SHUTDOWN between steps does:
    ``on_exit(None)``, no error kept."""
    ffn, (attn,) = _pair()
    _start_all(ffn, attn)
    exits: list[BaseException | None] = []

    def compute(layer_idx: int, batch) -> torch.Tensor:
        raise raised

    loop = FFNLoop(ffn, compute, LAYERS, on_exit=exits.append)
    loop.start()
    attn.send_plan(StepPlan(1, ExecMode.EAGER, (2,)))
    attn.send_a2f(0, 0, torch.ones(2, HIDDEN))
    loop._thread.join(10)
    assert not loop.alive
    kept = None if isinstance(raised, AFDPeerStopped) else raised
    assert loop.error is kept and exits == [kept]
    ffn.close()
    with pytest.raises(AFDPeerError):
        attn.recv_f2a(0, 0)
    attn.close()


def test_ffn_loop_stop_unblocks_an_idle_loop_without_error() -> None:
    ffn, (attn,) = _pair()
    _start_all(ffn, attn)
    exits: list[BaseException | None] = []
    loop = FFNLoop(ffn, _compute, LAYERS, on_exit=exits.append)
    loop.start()
    loop.stop(timeout=10)
    assert not loop.alive
    assert exits == [None] and loop.error is None
    attn.close()


class _DeferredGraphs:
    """Step graphs with CUDA graph semantics on CPU: capture records the step
    without running it; replay runs what was recorded."""

    def __init__(self) -> None:
        self.recorded: dict = {}

    def capture(self, plan, serve) -> None:
        self.recorded[plan.peer_tokens] = serve

    def replay(self, plan) -> bool:
        serve = self.recorded.get(plan.peer_tokens)
        if serve is None:
            return False
        serve()
        return True


def _exchange_step(conn, tokens: int, gen: torch.Generator) -> bool:
    ok = True
    for layer in LAYERS:
        hidden = torch.randn(tokens, HIDDEN, generator=gen)
        conn.send_a2f(layer, 0, hidden)
        ok &= torch.equal(conn.recv_f2a(layer, 0), hidden * 2 + layer)
    return ok


def test_ffn_loop_captures_replays_on_a_hit_and_runs_eager_on_a_miss() -> None:
    ffn, (attn,) = _pair()
    _start_all(ffn, attn)
    graphs = _DeferredGraphs()
    loop = FFNLoop(ffn, _compute, LAYERS, graphs=graphs)
    loop.start()
    gen = torch.Generator().manual_seed(0)
    attn.send_plan(StepPlan(1, ExecMode.EAGER, (3,)))
    assert _exchange_step(attn, 3, gen)
    # A capture records on both sides and moves no data.
    attn.send_plan(StepPlan(2, ExecMode.CAPTURE, (4,)))
    attn.send_plan(StepPlan(3, ExecMode.REPLAY, (4,)))
    assert _exchange_step(attn, 4, gen)  # replayed from the recorded step
    attn.send_plan(StepPlan(4, ExecMode.REPLAY, (5,)))
    assert _exchange_step(attn, 5, gen)  # no graph of this layout: eager
    attn.close()
    loop._thread.join(10)
    assert loop.error is None
    assert list(graphs.recorded) == [((4,),)]
    stats = loop.stats
    assert (stats.steps, stats.graph_captures, stats.graph_replays) == (4, 1, 1)


def test_ffn_loop_without_graph_support_fails_a_capture_step() -> None:
    ffn, (attn,) = _pair()
    _start_all(ffn, attn)
    exits: list[BaseException | None] = []
    loop = FFNLoop(ffn, _compute, LAYERS, on_exit=exits.append)
    loop.start()
    attn.send_plan(StepPlan(1, ExecMode.CAPTURE, (2,)))
    loop._thread.join(10)
    assert "cannot capture graphs" in str(loop.error)
    assert exits == [loop.error]
    attn.close()


def test_metrics_read_the_ffn_counters_between_steps_only() -> None:
    """A step served halfway (layer 0 of 3 exchanged) has moved the F2A byte
    counter but not the token counter: the publisher reads nothing then, and
    after the step both describe the same whole step."""
    from vllm_afd.worker.metrics import endpoint_publisher

    ffn, (attn,) = _pair()
    _start_all(ffn, attn)
    loop = FFNLoop(ffn, _compute, LAYERS)
    loop.start()
    publisher = endpoint_publisher("ffn", 0, ffn, loop, interval=0.05)
    publisher.stop()  # its thread; snapshots are read by hand below
    tokens = 3
    try:
        attn.send_plan(StepPlan(1, ExecMode.EAGER, (tokens,)))
        attn.send_a2f(0, 0, torch.ones(tokens, HIDDEN))
        attn.recv_f2a(0, 0)
        assert ffn.stats.f2a_bytes > 0 and loop.stats.tokens == 0
        assert publisher.snapshot() is None  # mid-step: no reading
        for layer in LAYERS[1:]:
            attn.send_a2f(layer, 0, torch.ones(tokens, HIDDEN))
            attn.recv_f2a(layer, 0)
        values = None
        for _ in range(100):  # the loop counts the step just after the reply
            values = publisher.snapshot()
            if values is not None and values["tokens"] == tokens:
                break
        assert values is not None and values["tokens"] == tokens
        per_token = len(LAYERS) * HIDDEN * 4
        assert values["f2a_bytes"] == values["tokens"] * per_token
    finally:
        attn.close()
        loop.stop()
        ffn.close()


def _records(caplog, text: str, deadline_s: float = 10.0) -> list[str]:
    """The stall log's messages holding ``text``, waiting up to ``deadline_s``
    for the first."""
    import time

    end = time.monotonic() + deadline_s
    while True:
        found = [r.getMessage() for r in caplog.records if text in r.getMessage()]
        if found or time.monotonic() > end:
            return found
        threading.Event().wait(0.02)


def test_a_stalled_phase_of_the_ffn_logs_its_stack_and_a_wait_does_not(
    caplog,
) -> None:
    """A compute that does not return logs the serving thread's stack after
    its bound (naming the step, its mode, the layer and the function
    it is in), then how long it took once it returns; the FFN rank waiting
    longer for an attention rank's rows logs nothing."""
    caplog.set_level("WARNING", logger="vllm_afd.worker.stall_watch")
    release = threading.Event()

    def stuck_at_layer_1(layer_idx: int, batch) -> torch.Tensor:
        if layer_idx == 1:
            release.wait(30)
        return _compute(layer_idx, batch)

    ffn, (attn,) = _pair()
    _start_all(ffn, attn)
    watch = StallWatch("ffn rank 0", 0.2, describe_plan)
    loop = FFNLoop(ffn, stuck_at_layer_1, LAYERS, watch=watch)
    loop.start()
    try:
        attn.send_plan(StepPlan(1, ExecMode.EAGER, (3,)))
        attn.send_a2f(0, 0, torch.ones(3, HIDDEN))
        attn.recv_f2a(0, 0)
        threading.Event().wait(0.6)  # the FFN waits for layer 1's rows: no report
        assert not _records(caplog, "AFD ffn rank 0", deadline_s=0)
        attn.send_a2f(1, 0, torch.ones(3, HIDDEN))
        (stalled,) = _records(caplog, "computing for")
        assert stalled.startswith(
            "AFD ffn rank 0: step 1 (EAGER, 3 tokens): layer 1, computing for "
        ), stalled
        assert "in stuck_at_layer_1" in stalled and "release.wait(30)" in stalled
        release.set()
        attn.recv_f2a(1, 0)
        (ended,) = _records(caplog, "ended after")
        assert ended.startswith("AFD ffn rank 0: step 1 (EAGER, 3 tokens): layer 1, ")
        attn.send_a2f(2, 0, torch.ones(3, HIDDEN))
        assert torch.equal(attn.recv_f2a(2, 0), torch.ones(3, HIDDEN) * 2 + 2)
    finally:
        release.set()
        attn.close()
        loop.stop()
        ffn.close()
    assert len(_records(caplog, "AFD ffn rank 0", deadline_s=0)) == 2
