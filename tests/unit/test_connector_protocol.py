"""Unit tests of the connector wire protocol and plan merging (no transport)."""

from __future__ import annotations

import dataclasses
import struct

import pytest

from vllm_afd.connector import protocol
from vllm_afd.connector.plan import merge_plans
from vllm_afd.connector.protocol import (
    MAX_LAYERS,
    MAX_UBATCHES,
    ExchangeKey,
    ExecMode,
    Fingerprint,
    Kind,
    StepPlan,
    exchange_tag,
    step_tag,
)
from vllm_afd.errors import AFDProtocolError

FP = Fingerprint(
    arch="DeepseekV2ForCausalLM", hidden_size=7168, dtype="bfloat16", num_layers=4,
    moe_layers=(1, 2, 3), num_experts=64, top_k=6, num_attention_ranks=2,
    num_ffn_ranks=1, compute_gate_on_attention=False, connector="p2p",
)  # fmt: skip


def test_frames_round_trip_and_split_delivery():
    msgs = [StepPlan(7, ExecMode.REPLAY, (3, 0)).to_wire(), protocol.shutdown("bye")]
    data = b"".join(protocol.encode(m) for m in msgs)
    buf = bytearray()
    got = []
    for i in range(len(data)):  # one byte at a time
        buf += data[i : i + 1]
        got += protocol.decode_frames(buf)
    assert got == msgs and not buf
    assert StepPlan.from_wire(got[0]) == StepPlan(7, ExecMode.REPLAY, (3, 0))


def test_decode_rejects_garbage_oversize_and_unknown_type():
    with pytest.raises(AFDProtocolError, match="exceeds"):
        protocol.decode_frames(bytearray(struct.pack(">I", 1 << 30)))
    with pytest.raises(AFDProtocolError, match="undecodable"):
        protocol.decode(b"\xff{")
    with pytest.raises(AFDProtocolError, match="no known message type"):
        protocol.decode(b'{"type": "NOPE"}')
    with pytest.raises(AFDProtocolError, match="malformed PLAN"):
        StepPlan.from_wire({"type": "PLAN", "step_id": 1, "mode": 9})


def test_step_plan_validates_counts():
    with pytest.raises(AFDProtocolError, match="negative"):
        StepPlan(0, ExecMode.EAGER, (1, -1))
    with pytest.raises(AFDProtocolError, match="ubatches"):
        StepPlan(0, ExecMode.EAGER, (1,) * (MAX_UBATCHES + 1))
    assert StepPlan(0, ExecMode.EAGER, (2, 3)).num_tokens == 5


def test_exchange_tags_are_unique_and_fit_31_bits():
    keys = [
        ExchangeKey(s, layer, u, k)
        for s in (0, 1, (1 << 16) - 1)
        for layer in (0, 1, MAX_LAYERS - 1)
        for u in range(MAX_UBATCHES)
        for k in Kind
    ]
    tags = {k.tag for k in keys}
    assert len(tags) == len(keys)
    assert all(0 <= t < 2**31 for t in tags)
    assert ExchangeKey(12, 3, 0, Kind.F2A).describe("from ffn rank 0") == (
        "f2a from ffn rank 0 (step 12, layer 3, ubatch 0)"
    )


@pytest.mark.parametrize(
    ("sent_step", "current_step"),
    [(0, 0), (7, 9), (70000, 70000), ((1 << 16) - 1, 1 << 16), (5, 5 + (1 << 16) - 1)],
)
def test_exchange_key_from_tag_recovers_the_step_the_tag_was_sent_in(
    sent_step, current_step
):
    # Error messages decode a pending exchange's tag; the tag keeps 16 bits
    # of the step, the rest comes from the current step.
    for key in (
        ExchangeKey(sent_step, MAX_LAYERS - 1, MAX_UBATCHES - 1, Kind.A2F_TOPK_IDS),
        ExchangeKey(sent_step, 0, 0, Kind.F2A),
    ):
        assert ExchangeKey.from_tag(key.tag, current_step) == key
        bits = step_tag(sent_step)
        assert exchange_tag(bits, key.layer_idx, key.ubatch_idx, key.kind) == key.tag


def test_fingerprint_diff_digest_and_wire():
    other = dataclasses.replace(FP, dtype="float16", top_k=8)
    assert FP.diff(other) == ["dtype", "top_k"]
    assert FP.diff(FP) == []
    assert "top_k: a=6 b=8" in FP.describe_diff(other, "a", "b")
    assert FP.digest != other.digest and len(FP.digest) == 12
    assert Fingerprint.from_wire(FP.to_wire()) == FP
    with pytest.raises(AFDProtocolError, match="lacks fields"):
        Fingerprint.from_wire({"arch": "x"})


def test_hello_carries_version_and_fingerprint():
    msg = protocol.decode(protocol.encode(protocol.hello("attention", 1, FP, None))[4:])
    assert msg["version"] == protocol.PROTOCOL_VERSION
    assert Fingerprint.from_wire(msg["fingerprint"]) == FP


def test_merge_plans_concatenates_in_peer_order_with_zero_ranks():
    plans = [
        StepPlan(4, ExecMode.EAGER, (2, 3)),
        StepPlan(4, ExecMode.EAGER, ()),  # no work this step
        StepPlan(4, ExecMode.EAGER, (1, 0)),
    ]
    m = merge_plans((2, 3, 4), plans)
    assert m.peer_tokens == ((2, 3), (0, 0), (1, 0))
    assert m.ubatch_tokens == (3, 3) and m.num_tokens == 6
    assert m.offsets == ((0, 0), (2, 3), (2, 3))


def test_merge_plans_mixes_eager_and_warmup_as_warmup():
    plans = [StepPlan(3, ExecMode.WARMUP, (1,)), StepPlan(3, ExecMode.EAGER, (5,))]
    m = merge_plans((0, 1), plans)
    assert m.mode is ExecMode.WARMUP and m.ubatch_tokens == (6,)
    with pytest.raises(AFDProtocolError, match="REPLAY"):
        merge_plans((0, 1), [plans[0], StepPlan(3, ExecMode.REPLAY, (5,))])


def test_merge_plans_rejects_disagreeing_peers():
    a = StepPlan(1, ExecMode.EAGER, (1,))
    with pytest.raises(AFDProtocolError, match="rank 1 sent step 2"):
        merge_plans((0, 1), [a, StepPlan(2, ExecMode.EAGER, (1,))])
    with pytest.raises(AFDProtocolError, match="CAPTURE"):
        merge_plans((0, 1), [a, StepPlan(1, ExecMode.CAPTURE, (1,))])
    with pytest.raises(AFDProtocolError, match="rank 0 planned 1 ubatch in step 1"):
        merge_plans((0, 1), [a, StepPlan(1, ExecMode.EAGER, (1, 1))])
