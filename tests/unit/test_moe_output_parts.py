"""MoE output parts: F2A widths in the connector and the attention-side add.

With ``moe_output_parts=2`` an MoE layer's F2A tensor is ``[T, 2H]`` (shared |
routed expert outputs) and a dense layer's stays ``[T, H]``; the attention
role finishes the MoE output as vLLM's MoE runner does.
"""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from vllm_afd.config import parse_afd_config
from vllm_afd.connector import ExecMode, Fingerprint, StepPlan, create_connector
from vllm_afd.errors import AFDProtocolError

H = 8
_ports = itertools.count(42100)


def _fingerprint(parts: int) -> Fingerprint:
    return Fingerprint(
        arch="TinyMoE", hidden_size=H, dtype="bfloat16", num_layers=3,
        moe_layers=(1, 2), num_experts=4, top_k=2, num_attention_ranks=1,
        num_ffn_ranks=1, compute_gate_on_attention=False, connector="loopback",
        moe_output_parts=parts,
    )  # fmt: skip


def _pair(attention_parts: int, ffn_parts: int):
    port = next(_ports)

    def make(role: str, parts: int):
        cfg = parse_afd_config(
            {"role": role, "connector": "loopback", "port": port,
             "connector_extra_config": {"timeout_s": 5.0}}
        )  # fmt: skip
        return create_connector(cfg, 0, _fingerprint(parts), "cpu")

    ffn, att = make("ffn", ffn_parts), make("attention", attention_parts)
    errors: list[BaseException] = []

    def start(c) -> None:
        try:
            c.start()
        except BaseException as e:  # kept for the assertion
            errors.append(e)

    threads = [threading.Thread(target=start, args=(c,)) for c in (ffn, att)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return ffn, att, errors


def test_moe_layers_carry_two_hidden_widths_back_and_dense_layers_one():
    ffn, att, errors = _pair(2, 2)
    assert not errors
    att.send_plan(StepPlan(1, ExecMode.EAGER, (3,)))
    assert ffn.recv_plan() is not None
    for layer, cols in ((0, H), (1, 2 * H), (2, 2 * H)):
        hidden = torch.randn(3, H, dtype=torch.bfloat16)
        att.send_a2f(layer, 0, hidden)
        batch = ffn.recv_a2f(layer, 0)
        assert torch.equal(batch.hidden, hidden)
        reply = torch.randn(3, cols, dtype=torch.bfloat16)
        if cols == 2 * H:
            with pytest.raises(AFDProtocolError, match=r"expect \(3, 16\)"):
                ffn.send_f2a(layer, 0, reply[:, :H].contiguous())
        ffn.send_f2a(layer, 0, reply)
        assert torch.equal(att.recv_f2a(layer, 0), reply)
        assert att.f2a_cols(layer) == cols
    att.close()
    ffn.close()


def test_roles_disagreeing_on_moe_output_parts_fail_the_handshake_naming_it():
    ffn, att, errors = _pair(2, 1)
    assert errors and all("moe_output_parts" in str(e) for e in errors), errors
    att.close()
    ffn.close()


@pytest.mark.parametrize(
    ("dtype", "scale"),
    [(torch.bfloat16, 1.0), (torch.bfloat16, 2.5), (torch.float16, 2.5)],
)
def test_finish_moe_output_is_vllm_runners_scale_then_add(dtype, scale):
    from vllm_afd.models.moe_tail import finish_moe_output

    shared = torch.randn(4, H).to(dtype)
    routed = torch.randn(4, H).to(dtype)
    # vllm/model_executor/layers/fused_moe/runner/moe_runner.py @ 0.32.0
    s, r = shared.clone(), routed.clone()
    if scale != 1.0:
        if r.dtype != torch.float16:
            r *= scale
        else:
            s *= 1.0 / scale
    expected = s + r
    out = finish_moe_output(torch.cat((shared, routed), dim=1), H, scale)
    assert torch.equal(out, expected)


def test_a_block_tail_runs_once_the_ffn_returns_what_the_moe_layer_returned():
    """``block_tail`` (Cohere2-MoE's average of shared and routed outputs):
    with the gate on the FFN role the FFN runs the whole block but returns the
    MoE layer's own output, which the block on attention then finishes."""
    from torch import nn

    from vllm_afd.models.ffn_layers import _runner_output_in

    class Runner(nn.Module):
        def forward(self, hidden_states, router_logits):
            return hidden_states * 3 + router_logits

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = Runner()

        def forward(self, hidden):
            return self.experts(hidden, hidden.sum(-1, keepdim=True)) / 2

    block = Block()
    hidden = torch.arange(6.0).view(2, 3)
    run = _runner_output_in(block, block.experts)
    inner = hidden * 3 + hidden.sum(-1, keepdim=True)
    for _ in range(2):  # each call returns its own output
        assert torch.equal(run(hidden), inner)
    assert torch.equal(block(hidden), inner / 2)  # the block on attention
