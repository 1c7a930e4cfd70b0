"""Roles on checkpoints of the same shapes but other weights refuse each other.

The FFN role serves a tiny Qwen3-MoE written with ``--seed 1``, the attention
role the same family with ``--seed 0``: same config, same shapes. The handshake
compares the roles' model digests (``vllm_afd.worker.identity``), so both
roles fail at start-up naming ``model_digest``, and neither ever serves a
token.
"""

from __future__ import annotations

import time

import pytest
from harness import LogSink, make_spec

from vllm_afd.deploy import role_processes
from vllm_afd.models.tiny_checkpoint import write_tiny_checkpoint

pytestmark = pytest.mark.e2e

EXIT_TIMEOUT_S = 300.0


def test_roles_with_other_weights_both_fail_naming_model_digest(tmp_path):
    mine = write_tiny_checkpoint(tmp_path / "s0", arch="qwen3_moe", num_layers=2)
    other = write_tiny_checkpoint(
        tmp_path / "s1", arch="qwen3_moe", num_layers=2, seed=1
    )
    spec = make_spec(mine, ["--dtype", "float32", "--enforce-eager"])
    ffn = next(p for p in role_processes(spec) if p.name == "ffn")
    attention = next(p for p in role_processes(spec) if p.name == "attention")
    ffn.argv = [str(other) if a == str(mine) else a for a in ffn.argv]
    log = LogSink()
    procs = (ffn, attention)
    try:
        for proc in procs:
            proc.start(log)
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while time.monotonic() < deadline:
            if all(p.exit_code() is not None for p in procs):
                break
            time.sleep(1.0)
        codes = {p.name: p.exit_code() for p in procs}
    finally:
        for proc in procs:
            proc.stop(10.0)
    text = log.getvalue()
    assert all(code not in (None, 0) for code in codes.values()), (
        codes,
        text[-3000:],
    )
    for name in ("ffn", "attention"):
        lines = [ln for ln in text.splitlines() if ln.startswith(f"[{name}]")]
        assert any("model_digest" in ln for ln in lines), (name, text[-3000:])
