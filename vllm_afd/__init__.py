"""vllm-afd: Attention-FFN Disaggregation for vLLM, as an out-of-tree plugin.

vLLM calls :func:`register` in every process it starts (front end, engine
core, workers) through the ``vllm.general_plugins`` entry point. Importing
this package needs neither vLLM nor torch.
"""

from __future__ import annotations

__version__ = "0.1.0"

_registered = False
_registration_error: BaseException | None = None


def register() -> None:
    """Install the plugin's hooks into vLLM. Idempotent and cheap.

    Never raises: vLLM loads every general plugin in every run, AFD or not.
    A failure is stored and re-raised by :func:`raise_if_registration_failed`
    when AFD is actually requested.
    """
    global _registered, _registration_error
    from vllm_afd import lifeline

    lifeline.install()  # per process: a forked child inherits _registered
    if _registered:
        return
    _registered = True
    try:
        _share_vllm_logging()
        from vllm_afd.compat import engine_config

        engine_config.install()
        from vllm_afd import envs

        if envs.server_pid() is not None:  # an engine or worker of an AFD server
            engine_config.register_afd_models()
            from vllm_afd.compat import engine_step, independent_ranks
            from vllm_afd.serving import stop_log

            engine_step.install()
            independent_ranks.install()
            stop_log.install()
    except Exception as exc:  # stored, re-raised when AFD is requested
        _registration_error = exc


def _share_vllm_logging() -> None:
    """Log ``vllm_afd.*`` through vLLM's handlers, format and level."""
    import logging

    import vllm.logger  # noqa: F401  (configures the "vllm" logger)

    source = logging.getLogger("vllm")
    target = logging.getLogger("vllm_afd")
    target.handlers = list(source.handlers)
    target.setLevel(source.level)
    target.propagate = False


def registration_error() -> BaseException | None:
    """The exception :func:`register` stored, if any."""
    return _registration_error


def raise_if_registration_failed() -> None:
    """Raise the stored registration failure (called when AFD is requested).

    Raises:
        AFDCompatError: with the stored cause chained.
    """
    if _registration_error is not None:
        from vllm_afd.errors import AFDCompatError

        raise AFDCompatError(
            f"vllm-afd failed to register with vLLM: {_registration_error}"
        ) from _registration_error
