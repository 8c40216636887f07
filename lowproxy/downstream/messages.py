"""What a handler sees of one exchange: the request, and the interface that answers it.

``ClientRequest`` is the read side (the request, and watching its client hang
up); ``ResponseWriter`` the write side, which the Responder (responder.py)
implements over one client connection. Handlers and the dispatch executor
depend on these two only, never on the connection.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from .._types import Headers


class ClientGone(Exception):
    """The client closed its connection or stopped accepting our bytes."""


class AbortResponse(Exception):
    """Raised by a handler to cut the response short: the connection closes with
    what was sent so far (no final chunk), so the client sees a truncated body."""


def _not_watched() -> None:
    pass


class ClientRequest:
    __slots__ = ("method", "target", "path_bytes", "path", "headers", "body", "http_version",
                 "_watch")

    def __init__(self, method: bytes, target: bytes, headers: Headers,
                 body: bytes, http_version: bytes,
                 watch: Callable[[], None] = _not_watched) -> None:
        self.method = method
        self.target = target  # path and query exactly as received
        self.path_bytes = target.split(b"?", 1)[0]  # the one split of the target
        self.path = self.path_bytes.decode("latin-1")
        self.headers = headers  # lowercased names, raw values, in order
        self.body = body
        self.http_version = http_version
        self._watch = watch

    def watch_client(self) -> None:
        """From now on, a client that hangs up cancels the handler (its connection
        reads the socket while the handler waits on a backend)."""
        self._watch()

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


class ResponseWriter(Protocol):
    """How a handler answers one request (see responder.Responder)."""

    started: bool
    ended: bool
    status: int
    bytes_out: int

    async def start(self, status: int, headers: Headers,
                    content_length: int | None = None) -> None: ...

    def informational(self, status: int, headers: Headers) -> None: ...

    def add_header(self, name: bytes, value: bytes) -> None: ...

    def buffer(self, data: bytes) -> None: ...

    def flush(self) -> None: ...

    def relay(self, pieces: list[bytes]) -> bool: ...

    async def write(self, data: bytes) -> None: ...

    async def end(self) -> None: ...

    @property
    def client_is_slow(self) -> bool: ...

    async def wait_for_client(self) -> None: ...

    async def send_bytes(self, status: int, body: bytes,
                         headers: Headers | None = None) -> None: ...

    async def send_json(self, status: int, obj: Any,
                        headers: Headers | None = None) -> None: ...

    def drop(self) -> None: ...

    @property
    def client_gone(self) -> bool: ...
