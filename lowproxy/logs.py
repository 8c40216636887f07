"""Log set-up: text or JSON lines on stderr, and the access line.

Nothing here ever receives a body, an Authorization value or the admin key:
callers pass only the fields below. The access line is formatted only when
INFO is enabled. configure() is called once, at start, like logging's own
set-up.
"""

from __future__ import annotations

import asyncio
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


class _AccessWriter:
    """Writes access lines straight to the daemon's log stream.

    The access line is the one log line every request pays for; a LogRecord
    (caller lookup, basename, a handler lock, a formatter) costs more than the
    rest of the line. Same format as the other lines; set up by configure().
    """

    def __init__(self, stream: Any, json_format: bool) -> None:
        self.stream = stream
        self.json_format = json_format
        self._second = -1
        self._stamp = ""
        self._lines: list[str] = []

    def _time(self) -> str:
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime(
                "%Y-%m-%dT%H:%M:%S" if self.json_format else "%Y-%m-%d %H:%M:%S",
                time.gmtime(now) if self.json_format else time.localtime(now))
        millis = int((now - second) * 1000)
        return (f"{self._stamp}.{millis:03d}Z" if self.json_format
                else f"{self._stamp},{millis:03d}")

    def write(self, fields: dict[str, Any]) -> None:
        if self.json_format:
            entry = {"time": self._time(), "level": "info", "logger": access_log.name,
                     "message": f"{fields['method']} {fields['path']} {fields['status']}"}
            entry.update(fields)
            line = json.dumps(entry, separators=(",", ":"), default=str)
        else:
            text = " ".join(f"{key}={'-' if value is None else value}"
                            for key, value in fields.items())
            line = f"{self._time()} INFO [{access_log.name}] {text}"
        self._lines.append(line)
        if len(self._lines) == 1:
            # Lines of one event-loop turn go out in one write, after the turn.
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no loop running: write now
                self.flush()

    def flush(self) -> None:
        lines, self._lines = self._lines, []
        try:
            self.stream.write("\n".join(lines) + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # a closed stderr must not fail requests
            pass


_writer: _AccessWriter | None = None


def configure(level: str, fmt: str) -> None:
    global _writer
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("lowproxy")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    _writer = _AccessWriter(sys.stderr, fmt == "json")


def warn(logger: logging.Logger, message: str, request_id: str | None = None,
         **fields: Any) -> None:
    """A warning an operator can act on, carrying the request id."""
    if request_id is not None:
        fields["request_id"] = request_id
    logger.warning("%s", message, extra={"fields": fields})


def access(fields: dict[str, Any]) -> None:
    if not access_log.isEnabledFor(logging.INFO):
        return
    if _writer is not None:
        _writer.write(fields)
        return
    text = " ".join(f"{key}={'-' if value is None else value}" for key, value in fields.items())
    access_log.info("%s", text, extra={"fields": fields})
