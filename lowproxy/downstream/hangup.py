"""A client transport's protocol with a call on the client's hang-up.

A handler waiting on a backend must learn that its client left (its upstream
exchange is then closed at once: a decode server aborts the request when its
connection drops). asyncio's streams offer no callback for it, and a task
reading the socket for it costs a task, its frame and a future per long
request; this wrapper costs one forwarded call per read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class HangUpHook(asyncio.Protocol):
    """asyncio's StreamReaderProtocol for one client, with a call on its hang-up.

    Put in front of the transport's protocol (BaseTransport.set_protocol), it
    forwards every callback and tells the connection when the client sent EOF
    or the connection was lost: a handler waiting on a backend learns of a
    hang-up with no task reading the socket for it.
    """

    __slots__ = ("inner", "on_hang_up")

    def __init__(self, inner: Any, on_hang_up: Callable[[], None]) -> None:
        self.inner = inner
        self.on_hang_up = on_hang_up

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        keep_open = self.inner.eof_received()
        self.on_hang_up()
        return keep_open

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)
        self.on_hang_up()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()
