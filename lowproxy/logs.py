"""Log set-up: text or JSON lines on stderr, and the access line.

Nothing here ever receives a body, an Authorization value or the admin key:
callers pass only the fields below. The access line is formatted only when
INFO is enabled.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

access_log = logging.getLogger("lowproxy.access")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, separators=(",", ":"), default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s [%(name)s] %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "fields", None)
        if fields and record.name != access_log.name:
            text += " " + " ".join(f"{key}={value}" for key, value in fields.items())
        return text


def configure(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("lowproxy")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def warn(logger: logging.Logger, message: str, request_id: str | None = None,
         **fields: Any) -> None:
    """A warning an operator can act on, carrying the request id."""
    if request_id is not None:
        fields["request_id"] = request_id
    logger.warning("%s", message, extra={"fields": fields})


def access(fields: dict[str, Any]) -> None:
    if not access_log.isEnabledFor(logging.INFO):
        return
    text = " ".join(f"{key}={'-' if value is None else value}" for key, value in fields.items())
    access_log.info("%s", text, extra={"fields": fields})
