"""Log set-up: text or JSON lines on stderr, and the access line.

Nothing here ever receives a body, an Authorization value or the admin key:
callers pass only the fields below. The access line is formatted only when
INFO is enabled. configure() is called once, at start, like logging's own
set-up.

Field values often carry client bytes (request id, path, trace id), so no
value may reach an operator's terminal or log parser as it came (CWE-117):
in text lines a value that is not plain is written as a JSON string literal
(quoted, backslash escapes, ASCII only), so no control character, escape
sequence or fake `` key=value`` field can appear; messages get their
non-printable characters escaped. JSON lines are json.dumps output with
ensure_ascii, valid JSON whatever the client sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import time
from typing import Any

access_log = logging.getLogger("lowproxy.access")
# Built once: json.dumps with arguments builds an encoder on every call.
_JSON_LINE = json.JSONEncoder(separators=(",", ":"), default=str)

_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")


def text_value(value: Any) -> str:
    """A field value as it may appear after ``key=`` in a text line.

    Plain values (printable ASCII without space, '=' or '"': the common case)
    are written as they are, after a few C-speed checks; anything else as a
    JSON string literal. None is "-", so a real "-" is quoted.
    """
    if value is None:
        return "-"
    text = value if isinstance(value, str) else str(value)
    if (text.isascii() and text.isprintable() and text and text != "-"
            and " " not in text and "=" not in text and '"' not in text):
        return text
    return json.dumps(text)


def text_fields(fields: dict[str, Any]) -> str:
    """``key=value`` pairs of a text line; keys are the proxy's own names.

    One check over all values joined serves the common line where every value
    is plain; only a line with something to escape looks at each value.
    """
    values = ["-" if value is None else value if type(value) is str else str(value)
              for value in fields.values()]
    joined = "".join(values)
    if not (joined.isascii() and joined.isprintable() and " " not in joined
            and "=" not in joined and '"' not in joined) or "" in values \
            or "-" in fields.values():
        values = [text_value(value) for value in fields.values()]
    return " ".join([f"{key}={value}" for key, value in zip(fields, values, strict=True)])


def text_message(message: str) -> str:
    """A message with every character outside printable ASCII backslash-escaped."""
    if message.isascii() and message.isprintable():
        return message
    return _UNPRINTABLE.sub(_escape_char, message)


def _escape_char(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 \
        else f"\\U{code:08x}"


class JsonFormatter(logging.Formatter):
    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.worker is not None:
            entry["worker"] = self.worker
        fields = getattr(record, "fields", None)
        if fields:
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return _JSON_LINE.encode(entry)


class TextFormatter(logging.Formatter):
    def __init__(self, worker: int | None = None) -> None:
        # With --workers, each line says which worker wrote it.
        shown = "" if worker is None else f" worker={worker}"
        super().__init__(f"%(asctime)s %(levelname)s [%(name)s]{shown} %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        # Escape the message only: a traceback appended after it keeps its lines.
        record.message = text_message(record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "fields", None)
        if fields and record.name != access_log.name:
            text += " " + text_fields(fields)
        return text


class _AccessWriter:
    """Writes access lines straight to the daemon's log stream.

    The access line is the one log line every request pays for; a LogRecord
    (caller lookup, basename, a handler lock, a formatter) costs more than the
    rest of the line. Same format as the other lines; set up by configure().
    """

    def __init__(self, stream: Any, json_format: bool, worker: int | None = None) -> None:
        self.stream = stream
        self.json_format = json_format
        self.worker = worker
        self._prefix = "" if worker is None else f"worker={worker} "
        self._second = -1
        self._stamp = ""
        self._lines: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None

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
            entry: dict[str, Any] = {"time": self._time(), "level": "info",
                                     "logger": access_log.name,
                                     "message": f"{fields['method']} {fields['path']} "
                                                f"{fields['status']}"}
            if self.worker is not None:
                entry["worker"] = self.worker
            entry.update(fields)
            line = _JSON_LINE.encode(entry)
        else:
            line = f"{self._time()} INFO [{access_log.name}] {self._prefix}{text_fields(fields)}"
        self._lines.append(line)
        if len(self._lines) == 1:
            # Lines of one event-loop turn go out in one write, after the turn. The
            # loop is remembered: asyncio.get_running_loop() costs a getpid() system
            # call on 3.11, once per request here.
            loop = self._loop
            if loop is None or not loop.is_running():
                try:
                    loop = self._loop = asyncio.get_running_loop()
                except RuntimeError:  # no loop running: write now
                    self.flush()
                    return
            loop.call_soon(self.flush)

    def flush(self) -> None:
        lines, self._lines = self._lines, []
        try:
            self.stream.write("\n".join(lines) + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # a closed stderr must not fail requests
            pass


_writer: _AccessWriter | None = None


def configure(level: str, fmt: str, worker: int | None = None) -> None:
    """Set up the log lines; a worker (--workers) calls it again, once, as it starts."""
    global _writer
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(worker) if fmt == "json" else TextFormatter(worker))
    root = logging.getLogger("lowproxy")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    _writer = _AccessWriter(sys.stderr, fmt == "json", worker)


def start_error(message: str, json_format: bool, **fields: Any) -> None:
    """A mistake found at start, before logging is set up: one line on stderr.

    Text: ``lowproxy: <message>`` (and a ``usage`` field as its own short line);
    JSON: one object, as every other line under PD_PROXY_LOG_FORMAT=json.
    """
    if json_format:
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "level": "error",
                 "logger": "lowproxy", "message": message, "exit_status": 2}
        entry.update({key: value for key, value in fields.items() if value})
        lines = [json.dumps(entry, separators=(",", ":"))]
    else:
        lines = [f"lowproxy: {text_message(message)}"]
        if fields.get("usage"):
            lines.append(fields["usage"])
    try:
        sys.stderr.write("\n".join(lines) + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # pragma: no cover - nowhere left to say it
        pass


def warn(logger: logging.Logger, message: str, request_id: str | None = None,
         **fields: Any) -> None:
    """A warning an operator can act on, carrying the request id."""
    if request_id is not None:
        fields["request_id"] = request_id
    logger.warning("%s", message, extra={"fields": fields})


def access_enabled() -> bool:
    """Whether an access line would be written: callers build its fields only then."""
    return access_log.isEnabledFor(logging.INFO)


def access(fields: dict[str, Any]) -> None:
    if not access_log.isEnabledFor(logging.INFO):
        return
    if _writer is not None:
        _writer.write(fields)
        return
    access_log.info("%s", text_fields(fields), extra={"fields": fields})
