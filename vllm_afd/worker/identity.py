"""Which model a role loads: a digest both roles compare at the handshake.

Two roles that hold checkpoints of the same shapes but other weights would
exchange tensors happily and serve wrong tokens. The digest covers what
changes the numbers:

* the model's config (vLLM's ``hf_config`` as loaded, before the model is
  built: :func:`remember_config`; as a canonical JSON), the dtype, the
  quantization method, and the load format;
* the weight files: for each ``*.safetensors`` / ``*.bin`` / ``*.pt`` file of
  the checkpoint directory, its name (relative to the directory), its size and
  :data:`SAMPLES` chunks of :data:`CHUNK` bytes at evenly spaced offsets, first
  and last included (the safetensors header, with every tensor's name, shape
  and offset, is in the first). Reading ``SAMPLES * CHUNK`` bytes per file
  keeps it to seconds for hundreds of GB; two checkpoints differing only in a
  few unsampled bytes are not told apart.
* ``--load-format dummy`` reads no files: its weights follow vLLM's seed, so
  the seed is digested instead.

Copies of one checkpoint at different paths or on different hosts give the
same digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from pathlib import Path
from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)

SAMPLES = 16
CHUNK = 64 * 1024
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
#: config keys that name where or by what a config was written, not the model
_VOLATILE_KEYS = ("_name_or_path", "transformers_version", "_commit_hash")
#: each config as loaded, before the model was built (``remember_config``):
#: id -> (the config, weakly, to tell a reused id apart; its JSON)
_AS_LOADED: dict[int, tuple[weakref.ref[Any], str]] = {}


def sample_file(path: Path, digest: Any) -> None:
    """Feed ``path``'s size and sampled chunks into ``digest``."""
    size = path.stat().st_size
    digest.update(f"{size}\n".encode())
    if size <= SAMPLES * CHUNK:
        digest.update(path.read_bytes())
        return
    last = size - CHUNK
    with path.open("rb") as f:
        for i in range(SAMPLES):
            f.seek(i * last // (SAMPLES - 1))
            digest.update(f.read(CHUNK))


def weights_digest(model_dir: Path) -> str:
    """Sampled digest of the weight files under ``model_dir`` ("" when none)."""
    digest = hashlib.sha256()
    files = sorted(
        p
        for p in model_dir.rglob("*")
        if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)
    )
    for path in files:
        digest.update(f"{path.relative_to(model_dir).as_posix()}\n".encode())
        sample_file(path, digest)
    return digest.hexdigest() if files else ""


def config_json(hf_config: Any) -> str:
    """The model config as canonical JSON, without where it was written."""
    d = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    for key in _VOLATILE_KEYS:
        d.pop(key, None)
    return json.dumps(d, sort_keys=True, default=str)


def remember_config(vllm_config: Any) -> None:
    """Keep the model config as vLLM loaded it, before the role builds its
    model: some models' vLLM code writes into it while building, and each role
    builds other parts (MiniMax-M2's attention class sets
    ``rope_parameters["partial_rotary_factor"]``, on the attention role only;
    its model class stores the role's ``max_model_len``).
    :func:`model_digest` digests the kept one."""
    hf_config = vllm_config.model_config.hf_config
    _AS_LOADED[id(hf_config)] = (weakref.ref(hf_config), config_json(hf_config))


def _local_dir(model: str, revision: str | None) -> Path | None:
    if os.path.isdir(model):
        return Path(model)
    try:  # a hub id the loader has fetched into the local cache
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except (OSError, ValueError) as exc:  # not cached locally: config only
        logger.warning(
            "AFD: no local files for %s (%s); the model digest covers its config only",
            model,
            exc,
        )
        return None


def model_digest(vllm_config: Any) -> str:
    """The digest of the model this role serves (sha256 hex, 16 digits)."""
    model = vllm_config.model_config
    load_format = str(getattr(vllm_config.load_config, "load_format", "auto"))
    ref, loaded = _AS_LOADED.get(id(model.hf_config), (None, None))
    if ref is None or ref() is not model.hf_config:
        loaded = config_json(model.hf_config)  # not remembered: as it is now
    parts = {
        "config": loaded,
        "dtype": str(model.dtype),
        "quantization": str(model.quantization),
        "load_format": load_format,
    }
    if load_format == "dummy":
        parts["seed"] = str(model.seed)
    else:
        local = _local_dir(model.model, model.revision)
        parts["weights"] = weights_digest(local) if local is not None else ""
    text = json.dumps(parts, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
