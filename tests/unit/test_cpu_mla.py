"""``vllm_afd.deploy.cpu_mla``: vLLM's reference CPU MLA named only for an MLA
checkpoint where vLLM would pick its AMX MLA, and never over a backend the
arguments already name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_afd.deploy import cpu_mla


def _checkpoint(root: Path, name: str, config: dict) -> Path:
    (root / name).mkdir()
    (root / name / "config.json").write_text(json.dumps(config))
    return root / name


@pytest.mark.parametrize("amx", [True, False])
def test_only_an_mla_checkpoint_gets_the_cpu_mla_backend_where_amx_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, amx: bool
) -> None:
    monkeypatch.setattr(cpu_mla, "amx_mla_would_serve", lambda: amx)
    mla = _checkpoint(tmp_path, "mla", {"kv_lora_rank": 512})
    nested = _checkpoint(tmp_path, "nested", {"text_config": {"kv_lora_rank": 512}})
    plain = _checkpoint(tmp_path, "gqa", {"num_key_value_heads": 2})
    expected = list(cpu_mla.CPU_MLA_ARGS) if amx else []
    assert cpu_mla.cpu_mla_args(mla) == expected
    assert cpu_mla.cpu_mla_args(nested) == expected
    assert cpu_mla.cpu_mla_args(plain) == []
    assert cpu_mla.cpu_mla_args(tmp_path / "missing") == []
    # the user's own choice stands
    assert cpu_mla.cpu_mla_args(mla, ["--attention-backend", "AMX_MLA"]) == []
    assert cpu_mla.cpu_mla_args(mla, ["--attention-backend=CPU_MLA"]) == []
