"""The API server's output-handler record on a stopped engine becomes one
INFO line; every other record of that logger is left as vLLM wrote it."""

from __future__ import annotations

import logging
import sys

import pytest

from vllm_afd.serving import stop_log


class EngineDeadError(Exception):
    """Stands in for vLLM's class: the filter matches the class name only."""


def _record(msg: str, exc: BaseException | None) -> logging.LogRecord:
    info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord(stop_log.LOGGER, logging.ERROR, __file__, 1, msg, (), info)


def test_engine_dead_in_the_output_handler_becomes_one_info_line():
    record = _record(stop_log.MESSAGE, EngineDeadError("gone"))
    assert stop_log.EngineGoneFilter().filter(record)
    assert record.levelno == logging.INFO and record.exc_info is None
    assert record.getMessage() == stop_log.STOPPED


@pytest.mark.parametrize(
    ("msg", "exc"),
    [
        (stop_log.MESSAGE, RuntimeError("a real failure")),
        ("something else failed", EngineDeadError("gone")),
        (stop_log.MESSAGE, None),
    ],
)
def test_other_records_stay_as_they_are(msg, exc):
    record = _record(msg, exc)
    assert stop_log.EngineGoneFilter().filter(record)
    assert record.levelno == logging.ERROR and record.msg == msg


def test_vllm_names_what_the_filter_matches():
    """The logger, message and class exist in the pinned vLLM."""
    import inspect

    from vllm.v1.engine import async_llm, exceptions

    assert async_llm.logger.name == stop_log.LOGGER
    assert stop_log.MESSAGE in inspect.getsource(async_llm)
    assert exceptions.EngineDeadError.__name__ == "EngineDeadError"
    assert "vllm" in sys.modules
