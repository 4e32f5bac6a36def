"""Process logging: `--log-format text|json`, and the ids of the request each line is about.

A JSON line is one object: ts (UTC, ISO 8601), level, logger, message, then whichever of
request_id, seq_id, seq_ids, trace_id, span_id apply, and `exception` with the traceback. A line
is about a request when it is logged inside log_context(...) (a contextvar: the router's front
doors bind the request id for the request's task, the services bind the seq ids and trace id of
each RPC, and the model thread inherits them), or names them itself: log.info(..., extra={...}).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

FIELDS = ("request_id", "seq_id", "seq_ids", "trace_id", "span_id")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_CONTEXT: ContextVar[dict[str, Any] | None] = ContextVar("tandem_log_context", default=None)  # replaced, never mutated


def add_log_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="json: one JSON object per line, with the request id (router) or the sequence ids "
                             "and trace id (services) of the request a line is about")


@contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Lines logged inside (and in tasks or threads started with a copy of this context) carry fields."""
    token = _CONTEXT.set({**(_CONTEXT.get() or {}), **fields})
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def bind(**fields: Any) -> None:
    """Like log_context, for the rest of the current task (a front door's handler runs in its own)."""
    _CONTEXT.set({**(_CONTEXT.get() or {}), **fields})


class ContextFilter(logging.Filter):
    """Copies the bound fields onto every record that does not set them itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in (_CONTEXT.get() or {}).items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        for key in FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def handler(fmt: str = "text", stream: Any = None) -> logging.Handler:
    h = logging.StreamHandler(stream)
    h.addFilter(ContextFilter())
    h.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    return h


def setup_logging(level: str, fmt: str = "text") -> None:
    """The root logger's one handler, in the chosen format (replaces what was there)."""
    logging.basicConfig(level=level.upper(), handlers=[handler(fmt)], force=True)
