"""Logging set-up of the daemons: text, or one JSON object a line (`--log-format json`).

Request ids travel with the request: `request_id` is the client's id (a label, or a generated one),
`engine_id` the engine's own key (unique, also the id of the Prefill call); handlers pass them as
`extra={"request_id": ...}`; the JSON format puts them in their own field, the text format escapes what
clients send. Prompts and tokens are never logged.
"""

from __future__ import annotations

import json
import logging
import time

_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


def _extras(record: logging.LogRecord) -> dict:
    """Fields passed with `extra=` (request_id, outcome, ...)."""
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


def escaped(value) -> str:
    """`value` as text on one line: control characters (a newline a client put in a field, which would
    forge a log line) written as escapes."""
    text = str(value)
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


class TextFormatter(logging.Formatter):
    """The usual line, with the extra fields appended as key=value; the message and the fields are
    escaped (one record is one line, whatever a client sent), the traceback after them is not."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = escaped(record.message)
        line = super().formatMessage(record)
        extras = " ".join(f"{k}={escaped(v)}" for k, v in _extras(record).items())
        return f"{line} {extras}".rstrip()


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(_extras(record))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
