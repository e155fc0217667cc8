"""The ``ninfer`` log handler: one JSON object per line or a readable line, structured fields
merged; nothing configured when the application says so; bad formats are one clear error."""

from __future__ import annotations

import io
import json
import logging

import pytest

from ninfer import logs
from ninfer.config import EngineConfig
from ninfer.errors import ConfigError


@pytest.fixture
def restore():
    """The ``ninfer`` logger as the test leaves it is put back; its children start at NOTSET (an
    in-process ``ninfer`` command earlier in this worker quiets some of them)."""
    from ninfer.cli import QUIET_UNLESS_ASKED
    logger = logging.getLogger("ninfer")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    children = {name: logging.getLogger(name).level for name in QUIET_UNLESS_ASKED}
    for name in children:
        logging.getLogger(name).setLevel(logging.NOTSET)
    yield logger
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]
    for name, level in children.items():
        logging.getLogger(name).setLevel(level)


def test_json_lines_carry_the_structured_fields(restore):
    buf = io.StringIO()
    logs.configure("json", stream=buf)
    logging.getLogger("ninfer.requests").info("request r1 length", extra={"ninfer": {"event": "request", "rid": "r1",
                                                                                      "ttft_s": 0.5}})
    logging.getLogger("ninfer.engine").warning("plain %s", "text")
    first, second = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert first["event"] == "request" and first["rid"] == "r1" and first["ttft_s"] == 0.5
    assert first["level"] == "INFO" and first["logger"] == "ninfer.requests" and first["message"] == "request r1 length"
    assert second["message"] == "plain text" and "event" not in second


def test_text_lines_and_one_handler(restore, monkeypatch):
    buf = io.StringIO()
    monkeypatch.setenv("NINFER_LOG_FORMAT", "json")
    logs.configure("text", stream=buf)                     # the argument wins over the environment
    logs.configure("text", stream=buf)                     # replaced, not added twice
    assert sum(getattr(h, "_ninfer_handler", False) for h in restore.handlers) == 1
    logging.getLogger("ninfer.stats").info("engine: prefill 1.0 tok/s")
    line = buf.getvalue().strip()
    assert line.endswith("INFO ninfer.stats: engine: prefill 1.0 tok/s") and not line.startswith("{")


def test_the_application_may_keep_logging_to_itself(restore, monkeypatch):
    monkeypatch.setenv("NINFER_CONFIGURE_LOGGING", "0")
    before = list(restore.handlers)
    assert logs.configure("json") is None and restore.handlers == before


def test_bad_formats():
    with pytest.raises(ConfigError, match="log_format='xml' is out of range: allowed text | json"):
        EngineConfig(log_format="xml")
    with pytest.raises(ConfigError, match="log_stats_interval_s"):
        EngineConfig(log_stats_interval_s=-1)
    with pytest.raises(ConfigError, match="log_format='yaml'"):
        logs.formatter("yaml")
