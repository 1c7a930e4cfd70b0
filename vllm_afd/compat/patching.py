"""Every change vllm-afd makes to vLLM, declared as data and applied by one function.

A :class:`Patch` names its target (``module:attr`` or ``module:Class.attr``),
the vLLM version it was written against, the signature it expects to find,
why it exists and when it can go. :func:`check_patch` refuses loudly when the
installed vLLM drifted; :func:`apply_patch` (process-wide) and
:func:`scoped_patch` (for the duration of a ``with`` block) go through it.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from vllm_afd.errors import AFDCompatError

PINNED_VLLM_VERSION = "0.32.0"


@dataclass(frozen=True)
class Patch:
    """One declared change to vLLM.

    Attributes:
        target: ``"package.module:Name"`` or ``"package.module:Class.attr"``.
        expected_params: parameter names of the original at the pinned
            version (``tuple(inspect.signature(original).parameters)``), or
            None where only the target's presence is checked: a non-callable
            target, or one wrapped as ``(*args, **kwargs)`` that passes any
            parameters through.
        reason: why the plugin needs it.
        removal: when it can be deleted.
        vllm_version: the vLLM version the signature was taken from.
    """

    target: str
    expected_params: tuple[str, ...] | None
    reason: str
    removal: str
    vllm_version: str = PINNED_VLLM_VERSION

    @property
    def module_name(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def attr_path(self) -> tuple[str, ...]:
        return tuple(self.target.split(":", 1)[1].split("."))


def _resolve_owner(patch: Patch) -> tuple[Any, str]:
    try:
        owner: Any = importlib.import_module(patch.module_name)
    except ImportError as exc:
        raise AFDCompatError(
            f"cannot patch {patch.target}: module {patch.module_name} is missing "
            f"in this vLLM (written for vLLM {patch.vllm_version}): {exc}"
        ) from exc
    *parents, name = patch.attr_path
    for part in parents:
        try:
            owner = getattr(owner, part)
        except AttributeError:
            raise AFDCompatError(
                f"cannot patch {patch.target}: {part!r} not found "
                f"(written for vLLM {patch.vllm_version})"
            ) from None
    if not hasattr(owner, name):
        raise AFDCompatError(
            f"cannot patch {patch.target}: {name!r} not found "
            f"(written for vLLM {patch.vllm_version})"
        )
    return owner, name


def current_params(obj: Any) -> tuple[str, ...] | None:
    """Parameter names of ``obj``, or None when it has no signature."""
    try:
        return tuple(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return None


def check_patch(patch: Patch) -> Any:
    """Return the original object at ``patch.target`` after checking it.

    Raises:
        AFDCompatError: the target is missing or its signature drifted.
    """
    owner, name = _resolve_owner(patch)
    original = inspect.getattr_static(owner, name)
    if isinstance(original, (staticmethod, classmethod)):
        original = original.__func__
    if patch.expected_params is not None:
        found = current_params(original)
        if found != patch.expected_params:
            raise AFDCompatError(
                f"vLLM drifted at {patch.target}: expected parameters "
                f"{patch.expected_params}, found {found}. vllm-afd was written "
                f"for vLLM {patch.vllm_version}; install that version or update "
                f"the patch ({patch.reason})"
            )
    return original


def apply_patch(patch: Patch, make_replacement: Callable[[Any], Any]) -> Any:
    """Replace ``patch.target`` process-wide with ``make_replacement(original)``.

    Idempotent: a target already replaced by vllm-afd is left alone.

    Returns:
        The replacement in place after the call.
    """
    owner, name = _resolve_owner(patch)
    current = getattr(owner, name)
    if getattr(current, "__afd_patch__", None) == patch.target:
        return current
    original = check_patch(patch)
    replacement = make_replacement(original)
    replacement.__afd_patch__ = patch.target
    replacement.__afd_original__ = original
    setattr(owner, name, replacement)
    return replacement


@contextlib.contextmanager
def scoped_patch(patch: Patch, replacement: Any) -> Iterator[Any]:
    """Swap ``patch.target`` for ``replacement`` inside a ``with`` block.

    The original is restored on every exit path, errors included.
    """
    owner, name = _resolve_owner(patch)
    original = check_patch(patch)
    saved = inspect.getattr_static(owner, name)
    setattr(owner, name, replacement)
    try:
        yield original
    finally:
        setattr(owner, name, saved)
