"""Structured logs: stdlib ``logging`` under the ``ninfer`` logger, one readable line or one JSON
object per record (``NINFER_LOG_FORMAT=json``, ``EngineConfig(log_format="json")`` or
``ninfer --log-format json``).

Records that carry data (the per-request summary, the periodic engine summary) put it under
``extra={"ninfer": {...}}``; the JSON formatter merges it into the object, so ``ninfer report``
reads the same fields the text line shows::

    {"time": 1718000000.1, "level": "INFO", "logger": "ninfer.requests", "message": "...",
     "event": "request", "rid": "local-3", "ttft_s": 0.12, ...}

Nothing is configured on import. ``configure`` installs one stderr handler on ``ninfer`` (and
stops propagation, as vLLM does, so a root handler does not print every line twice);
``NINFER_CONFIGURE_LOGGING=0`` leaves logging entirely to the application.
"""

from __future__ import annotations

import json
import logging
import os
import sys

FORMATS = ("text", "json")
_MARK = "_ninfer_handler"


def data(record: logging.LogRecord) -> dict | None:
    """The structured fields of a record (None for a plain message)."""
    return getattr(record, "ninfer", None)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (epoch seconds), level, logger, message, the record's
    structured fields, and the exception text when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        obj = {"time": round(record.created, 6), "level": record.levelname, "logger": record.name,
               "message": record.getMessage()}
        obj.update(data(record) or {})
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S")


def formatter(fmt: str) -> logging.Formatter:
    if fmt not in FORMATS:
        from ninfer.errors import ConfigError
        raise ConfigError(f"log_format={fmt!r} is out of range: allowed {' | '.join(FORMATS)}")
    return JsonFormatter() if fmt == "json" else TextFormatter()


def requested_format(fmt: str | None = None) -> str | None:
    """The format asked for: the argument, else ``NINFER_LOG_FORMAT``, else None (not asked)."""
    return fmt or os.environ.get("NINFER_LOG_FORMAT") or None


def configure(fmt: str | None = None, level: str | int | None = None, stream=None) -> logging.Handler | None:
    """Install (or replace) the ``ninfer`` handler: ``fmt`` "text" | "json" (default: the
    environment's, else text), ``level`` (default ``NINFER_LOG_LEVEL``, else INFO). Returns the
    handler, or None when ``NINFER_CONFIGURE_LOGGING=0``."""
    if os.environ.get("NINFER_CONFIGURE_LOGGING", "1") == "0":
        return None
    fmt = requested_format(fmt) or "text"
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter(fmt))
    setattr(handler, _MARK, True)
    logger = logging.getLogger("ninfer")
    for old in [h for h in logger.handlers if getattr(h, _MARK, False)]:
        logger.removeHandler(old)
    logger.addHandler(handler)
    logger.setLevel(level or os.environ.get("NINFER_LOG_LEVEL", "INFO").upper())
    logger.propagate = False
    return handler


def fmt_s(v: float | None) -> str:
    """Seconds for a text line ("-" when absent)."""
    return "-" if v is None else f"{v:.3f} s"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
