from __future__ import annotations

import os
import sys

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


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Tiny DeepSeek-V2 and -V3 checkpoints made locally, shared by the session."""
    from vllm_afd.models.tiny_checkpoint import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    return {
        arch: write_tiny_checkpoint(root / arch, arch=arch, num_layers=4)
        for arch in ("deepseek_v2", "deepseek_v3")
    }


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """A tiny checkpoint of every family ``vllm-afd tiny-model`` writes (3
    layers: layer 0 dense where the family has dense layers)."""
    from vllm_afd.models.tiny_checkpoint import TINY_ARCHS, write_tiny_checkpoint

    root = tmp_path_factory.mktemp("families")
    return {
        arch: write_tiny_checkpoint(root / arch, arch=arch, num_layers=3)
        for arch in TINY_ARCHS
    }
