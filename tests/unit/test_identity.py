"""The model digest both roles compare at the handshake (vllm_afd.worker.identity)."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

identity = pytest.importorskip("vllm_afd.worker.identity")
transformers = pytest.importorskip("transformers")

from vllm_afd.models.tiny_checkpoint import write_tiny_checkpoint  # noqa: E402


def _vllm_config(model: Path | str, dtype: str = "float32", **load: str):
    hf = transformers.AutoConfig.from_pretrained(str(model))
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model=str(model),
            revision=None,
            hf_config=hf,
            dtype=dtype,
            quantization=None,
            seed=load.get("seed", "0"),
        ),
        load_config=SimpleNamespace(load_format=load.get("load_format", "auto")),
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("identity")
    a = write_tiny_checkpoint(root / "a", arch="qwen3_moe", num_layers=2, seed=0)
    b = write_tiny_checkpoint(root / "b", arch="qwen3_moe", num_layers=2, seed=1)
    copy = root / "elsewhere" / "a-copy"
    shutil.copytree(a, copy)
    return a, b, copy


def test_digest_same_shapes_other_weights_differ(models):
    a, b, _ = models
    assert identity.model_digest(_vllm_config(a)) != identity.model_digest(
        _vllm_config(b)
    )


def test_digest_copy_at_another_path_is_the_same(models):
    a, _, copy = models
    assert identity.model_digest(_vllm_config(a)) == identity.model_digest(
        _vllm_config(copy)
    )


def test_digest_covers_dtype_and_dummy_seed(models):
    a, _, _ = models
    fp32 = identity.model_digest(_vllm_config(a))
    assert identity.model_digest(_vllm_config(a, dtype="bfloat16")) != fp32
    d0 = identity.model_digest(_vllm_config(a, load_format="dummy", seed="0"))
    d1 = identity.model_digest(_vllm_config(a, load_format="dummy", seed="1"))
    assert d0 != d1 and d0 != fp32


def test_sample_file_reads_sampled_chunks_of_a_large_file(tmp_path):
    import hashlib

    big = tmp_path / "w.safetensors"
    size = identity.SAMPLES * identity.CHUNK * 4
    data = bytearray(size)
    big.write_bytes(bytes(data))
    before = hashlib.sha256()
    identity.sample_file(big, before)
    # a byte inside the last sampled chunk changes the digest
    data[-1] = 1
    big.write_bytes(bytes(data))
    after = hashlib.sha256()
    identity.sample_file(big, after)
    assert before.hexdigest() != after.hexdigest()


def test_digest_is_of_the_config_as_loaded_before_the_model_is_built(models):
    """MiniMax-M2's vLLM code writes into the config while it builds, and
    differently on each role (its attention class, on the attention role
    only, adds ``rope_parameters["partial_rotary_factor"]``): the digest is
    of the config each role remembered before building."""
    a, _, _ = models
    one, other = _vllm_config(a), _vllm_config(a)
    for config in (one, other):
        identity.remember_config(config)
    other.model_config.hf_config.rope_parameters = {"partial_rotary_factor": 0.5}
    other.model_config.hf_config.max_model_len = 4096
    assert identity.model_digest(one) == identity.model_digest(other)
    changed = _vllm_config(a)  # remembered nothing: its config as it is now
    changed.model_config.hf_config.hidden_size += 16
    assert identity.model_digest(changed) != identity.model_digest(one)
