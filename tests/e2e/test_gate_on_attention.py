"""Gate placement: exact either way, and each role holds only its weights.

* ``compute_gate_on_attention=true``: attention runs the gate and top-k and
  ships ``topk_weights``/``topk_ids`` with the hidden states; dense MLP
  layers run on attention; the FFN holds experts only, never the gate.
  DeepSeek-V3 (sigmoid, correction bias, grouped top-k), fp32, against
  plain vLLM; and DeepSeek-V3 compiled in bf16, where the FFN also ships
  shared and routed expert outputs apart. Softmax greedy top-k (DeepSeek-V2's
  routing) runs with the gate on attention in ``test_families.py`` (Qwen2-MoE,
  Qwen3-MoE, Mixtral).
* Default (gate on FFN): checked in ``test_exact_1a1f.py`` (the attention
  role holds no MLP/MoE bytes at all; A2F is the hidden states alone).

A2F bytes are checked against the layout: per token and remote layer,
``H * 4`` (fp32 hidden) plus ``K * (4 + 4)`` (fp32 weights, int32 ids).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import (
    COMPILED_BF16_V3,
    afd_vs_plain,
    assert_same_outputs,
    make_spec,
    parameter_bytes,
    prompts,
)

pytestmark = pytest.mark.e2e

ATTENTION_ONLY = ("embed_tokens", "lm_head", "norms", "attention")


FP32_EAGER = ["--dtype", "float32", "--enforce-eager"]


def _run(tiny_models, arch, gate_on_attention, args=FP32_EAGER):
    spec = make_spec(
        tiny_models[arch],
        args,
        gate_on_attention=gate_on_attention,
    )
    run = afd_vs_plain(spec, prompts(16), metrics="ffn")
    return run.afd, run.plain, parameter_bytes(run.log), run.metrics


def _config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def test_gate_on_attention_exact_and_ffn_holds_experts_only(tiny_models):
    arch = "deepseek_v3"
    afd_out, plain_out, params, ffn_metrics = _run(tiny_models, arch, True)
    assert_same_outputs(afd_out, plain_out, atol=0.0)  # admitted together

    attention, ffn = params["attention"], params["ffn"]
    assert attention["gate"] > 0 and attention["dense_mlp"] > 0
    assert attention["routed_experts"] == attention["shared_experts"] == 0
    assert ffn["gate"] == ffn["dense_mlp"] == 0
    assert ffn["routed_experts"] > 0 and ffn["shared_experts"] > 0
    assert all(ffn[group] == 0 for group in ATTENTION_ONLY)

    cfg = _config(tiny_models[arch])
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    per_token = moe_layers * (cfg["hidden_size"] * 4 + cfg["num_experts_per_tok"] * 8)
    tokens = ffn_metrics[("afd_ffn_tokens", "ffn", "0")]
    assert ffn_metrics[("afd_a2f_bytes", "ffn", "0")] == tokens * per_token


@COMPILED_BF16_V3
def test_gate_on_attention_compiled_bf16_exact(tiny_models):
    afd_out, plain_out, _, ffn_metrics = _run(
        tiny_models, "deepseek_v3", True, ["--dtype", "bfloat16"]
    )
    assert_same_outputs(afd_out, plain_out, atol=1e-2)
    # F2A: shared | routed outputs, 2 H bf16 values per token and MoE layer.
    cfg = _config(tiny_models["deepseek_v3"])
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    tokens = ffn_metrics[("afd_ffn_tokens", "ffn", "0")]
    per_token = moe_layers * 2 * cfg["hidden_size"] * 2
    assert ffn_metrics[("afd_f2a_bytes", "ffn", "0")] == tokens * per_token
