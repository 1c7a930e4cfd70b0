from __future__ import annotations

import contextlib
import functools
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Small KV cache: the tiny models need little and CI machines have 2 cores.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# The end-to-end servers run vLLM's worker inside its engine-core process:
# a server ready in about half the time (``harness.LAYOUT_KEY``). Modules
# marked ``worker_processes`` (the launcher, the demo)
# run vLLM's CPU default, a worker process per engine core.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(scope="module", autouse=True)
def _vllm_layout(request):
    """vLLM's CPU default layout for a module marked ``worker_processes``,
    set before its module fixtures start servers."""
    from harness import LAYOUT_KEY

    before = os.environ[LAYOUT_KEY]
    if request.node.get_closest_marker("worker_processes") is not None:
        os.environ[LAYOUT_KEY] = "1"
    yield
    os.environ[LAYOUT_KEY] = before


@pytest.fixture(scope="session", autouse=True)
def server_pool():
    """The session's shared server lifetimes (``harness.POOL``), stopped at
    the end; vLLM's model-info cache filled first (``warm_registry.py``; one
    process at a time)."""
    import fcntl
    import subprocess

    import forks
    import harness

    lock = os.path.join(os.environ["AFD_TEST_SESSION_DIR"], "warm-registry.lock")
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        script = os.path.join(os.path.dirname(__file__), "warm_registry.py")
        subprocess.run([sys.executable, script], check=True, timeout=300)

    # two workers, each with a pool, share the host's memory
    harness.POOL.keep = 3 if harness.xdist_workers() == 1 else 2
    # role processes forked from processes that imported vLLM once (CPU)
    if (
        os.environ.get("AFD_TEST_FORK_SERVERS", "1") != "0"
        and not harness.cuda_visible()
    ):
        forks.install()
    try:
        yield harness.POOL
    finally:
        harness.POOL.close()
        harness.PLAIN_RUNNER.close()
        forks.close()


@pytest.fixture(autouse=True)
def _servers_of_this_test(server_pool):
    """The pool protects from eviction only the servers the running test
    asked for (``ServerPool.release``)."""
    server_pool.release()
    yield
    server_pool.release()
    server_pool.trim()


@pytest.fixture
def quiet_host():
    """No idle server of the pool beside this test: it times things, starts
    many servers of its own, or breaks them."""
    import harness

    harness.POOL.close()


#: where the session's tiny checkpoints are kept between sessions
MODEL_STORE_VAR = "AFD_TEST_MODEL_STORE"


@functools.cache
def _model_store() -> tuple[Path, str]:
    """``$AFD_TEST_MODEL_STORE`` (default ``~/.cache/vllm-afd/test-models``)
    and a key of the checkpoint writer's code and transformers' version."""
    import hashlib

    import transformers

    import vllm_afd.models as models

    digest = hashlib.sha256(f"{transformers.__version__}".encode())
    for name in sorted(Path(models.__file__).parent.glob("tiny_*.py")):
        digest.update(name.read_bytes())
    default = Path.home() / ".cache" / "vllm-afd" / "test-models"
    return Path(os.environ.get(MODEL_STORE_VAR, default)), digest.hexdigest()[:16]


def stored_tiny_model(arch: str, num_layers: int) -> Path:
    """A tiny checkpoint of ``arch`` (``write_tiny_checkpoint``, which writes
    the same bytes for the same arguments), kept between sessions in the
    model store (:func:`_model_store`) under a name that changes with the
    writer's code and transformers' version. A stable path lets vLLM reuse
    what it compiled for the model in an earlier session: its compile cache
    is keyed by the model's path."""
    import shutil
    import tempfile

    from vllm_afd.models.tiny_checkpoint import write_tiny_checkpoint

    store, key = _model_store()
    # named as the architecture (the tests take a family from the name)
    path = store / f"{num_layers}-layers-{key}" / arch
    if not (path / "config.json").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{arch}-", dir=path.parent))
        write_tiny_checkpoint(staging / "model", arch=arch, num_layers=num_layers)
        # whole, or not at all; OSError: another process stored it first
        with contextlib.suppress(OSError):
            (staging / "model").rename(path)
        shutil.rmtree(staging, ignore_errors=True)
    return path


@pytest.fixture(scope="session")
def tiny_models():
    """Tiny DeepSeek-V2 and -V3 checkpoints made locally, shared by the session."""
    return {arch: stored_tiny_model(arch, 4) for arch in ("deepseek_v2", "deepseek_v3")}


class _TinyModels(dict):
    """``{arch: path}`` of 3-layer tiny checkpoints, each written (or taken
    from the store) when a test first asks for it: a session that runs a
    few families writes only theirs."""

    def __missing__(self, arch: str) -> Path:
        from vllm_afd.models.tiny_checkpoint import TINY_ARCHS

        if arch not in TINY_ARCHS:
            raise KeyError(arch)
        path = self[arch] = stored_tiny_model(arch, 3)
        return path


@pytest.fixture(scope="session")
def family_models():
    """A tiny checkpoint of every family ``vllm-afd tiny-model`` writes (3
    layers: layer 0 dense where the family has dense layers), on demand."""
    return _TinyModels()
