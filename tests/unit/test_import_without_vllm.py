"""``import vllm_afd`` works without vLLM and torch; register() never raises.

Runs a fresh interpreter in which a ``sys.meta_path`` finder makes every
``vllm`` and ``torch`` import fail, as on a machine without them.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKED_SCRIPT = textwrap.dedent(
    """
    import sys

    BLOCKED = ("vllm", "torch")


    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"blocked for the test: {name}")
            return None


    sys.meta_path.insert(0, Blocker())
    for name in list(sys.modules):
        if name.split(".")[0] in BLOCKED:
            del sys.modules[name]

    import vllm_afd
    import vllm_afd.config
    import vllm_afd.errors
    import vllm_afd.models.ownership
    import vllm_afd.topology
    from vllm_afd.errors import AFDCompatError

    assert vllm_afd.registration_error() is None
    vllm_afd.register()  # must not raise
    vllm_afd.register()  # idempotent
    error = vllm_afd.registration_error()
    assert isinstance(error, Exception), repr(error)
    assert "vllm" in str(error), error

    try:
        vllm_afd.raise_if_registration_failed()
    except AFDCompatError as exc:
        assert "failed to register" in str(exc), exc
        assert exc.__cause__ is error
    else:
        raise AssertionError("raise_if_registration_failed did not raise")

    leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not leaked, leaked
    print("OK")
    """
)


def test_import_vllm_afd_without_vllm_or_torch_stores_registration_error() -> None:
    result = subprocess.run(
        [sys.executable, "-c", BLOCKED_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "OK"


PARSE_SCRIPT = BLOCKED_SCRIPT.split("import vllm_afd\n", 1)[0] + textwrap.dedent(
    """
    from vllm_afd.config import AFDRole, parse_afd_config

    assert parse_afd_config({"role": "ffn"}).role is AFDRole.FFN
    print("OK")
    """
)


def test_parse_afd_config_without_vllm_or_torch_succeeds() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PARSE_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "OK"
