"""The tiny checkpoint gives the same greedy tokens in HF transformers and vLLM.

Proves the checkpoint is read the same way by both (weight names, MLA dims, rotary
layout, routing config), so it can stand in for a real DeepSeek model in exactness
tests. vLLM runs in a subprocess: its engine starts worker processes and keeps global
state that must not leak into the test process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_afd.deploy.cpu_mla import cpu_mla_args
from vllm_afd.models.tiny_checkpoint import DEEPSEEK_ARCHS, write_tiny_checkpoint

PROMPTS = (
    "The capital of France is",
    "Once upon a time there was a little robot",
    "Please write a short poem about the sea",
)
MAX_NEW_TOKENS = 16

# Runs in a fresh interpreter: argv = checkpoint dir, result file, prompts (JSON),
# max new tokens.
_VLLM_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams

model, result = sys.argv[1], sys.argv[2]
prompts = json.loads(sys.argv[3])
llm = LLM(
    model=model,
    dtype="float32",
    enforce_eager=True,
    max_model_len=512,
    seed=0,
    # vLLM 0.32's CPU rotary kernel mishandles DeepSeek's strided q_pe slice;
    # the native PyTorch rotary is exact.
    compilation_config={"custom_ops": ["all", "-rotary_embedding"]},
    # vLLM's reference CPU MLA where it would pick AMX MLA (deploy.cpu_mla)
    **json.loads(sys.argv[5]),
)
params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[4]))
outs = llm.generate(prompts, params)
chat = llm.chat([{"role": "user", "content": "Hello!"}], params)
with open(result, "w") as f:
    json.dump(
        {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "chat_tokens": list(chat[0].outputs[0].token_ids),
        },
        f,
    )
"""


def _hf_greedy(model_dir: Path) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt").input_ids
            gen = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
            out.append(gen[0, ids.shape[1] :].tolist())
    return out


def _vllm_greedy(model_dir: Path, tmp_path: Path) -> dict[str, list]:
    result = tmp_path / "vllm_result.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _VLLM_SCRIPT,
            str(model_dir),
            str(result),
            json.dumps(PROMPTS),
            str(MAX_NEW_TOKENS),
            json.dumps(
                {"attention_backend": "CPU_MLA"} if cpu_mla_args(model_dir) else {}
            ),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(result.read_text())


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None
    or importlib.util.find_spec("transformers") is None,
    reason="needs vLLM and transformers",
)
@pytest.mark.parametrize("arch", DEEPSEEK_ARCHS)
def test_tiny_model_greedy_matches_hf_token_for_token(
    tmp_path: Path, arch: str
) -> None:
    model_dir = write_tiny_checkpoint(tmp_path / arch, arch=arch, num_layers=4)

    hf = _hf_greedy(model_dir)
    vllm = _vllm_greedy(model_dir, tmp_path)

    assert vllm["tokens"] == hf
    # Not degenerate: varied tokens, different continuations per prompt.
    for tokens in hf:
        assert len(tokens) == MAX_NEW_TOKENS
        assert len(set(tokens)) > MAX_NEW_TOKENS // 2
    assert len({tuple(t) for t in hf}) == len(PROMPTS)
    # The chat template renders and the model answers.
    assert len(vllm["chat_tokens"]) > 0
