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


def _snapshot(prefill: int, busy: bool = True):
    from ninfer.engine.throughput import EngineSnapshot
    counters = {"prefill": prefill, "replay": 0, "generated": prefill // 2, "hits": 1, "queries": 2,
                "hit_losses": 0, "h2d": 0, "d2h": 4096, "preemptions": 0, "finished": 1,
                "controller_s": 0.01, "round_trips": 3, "protocol_bytes": 100}
    return EngineSnapshot(counters, busy, 2, 1, 0, 1 << 20, 1 << 19, {}, 0)


def test_the_engine_summary_reports_a_windows_rates_from_snapshots(monkeypatch, caplog):
    """The periodic summary reads the engine through snapshots only (no reference to the core):
    a closed window logs its differences as rates; an idle gap closes the window where the last
    cycle ran, so idle time never dilutes them."""
    from ninfer.engine import throughput
    clock = [100.0]
    monkeypatch.setattr(throughput.time, "monotonic", lambda: clock[0])
    summary = throughput.EngineSummary(1.0, _snapshot(0))
    caplog.set_level(logging.INFO, logger="ninfer.stats")
    clock[0] = 100.5
    summary.tick(lambda: _snapshot(50))
    assert not caplog.records                                  # the window is still open
    clock[0] = 101.0
    summary.tick(lambda: _snapshot(100))
    (rec,) = caplog.records
    assert rec.ninfer["prefill_tps"] == 100.0 and rec.ninfer["running"] == 2 and rec.ninfer["host_use"] == 0.5
    caplog.clear()
    clock[0] = 101.5                                            # busy until 101.5, then idle until 111.5
    summary.tick(lambda: _snapshot(150))
    clock[0] = 111.5
    summary.tick(lambda: _snapshot(200, busy=False))
    (rec,) = caplog.records
    assert rec.ninfer["interval_s"] == 0.5 and rec.ninfer["prefill_tps"] == 200.0   # 100 tokens in 0.5 s
