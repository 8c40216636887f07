"""The two asyncio internals lowproxy touches, both for the memory a connection holds.

A selector transport's read callback:

On asyncio's own loop (not uvloop, whose transports are C objects) a socket
transport keeps its read callback as a bound method of itself
(``_SelectorSocketTransport._read_ready_cb``, CPython 3.11-3.13). Every such
transport is therefore in a reference cycle and outlives its close until the
cyclic GC's next full pass, with its socket objects and address tuples. After a
burst of short connections (a few hundred prefill legs opened at once, then
discarded because the idle pool is full) that is megabytes of RSS held for
minutes. Clearing the attribute once the transport is closing lets reference
counting free it at once (3.12 clears it in close() itself, not in abort()).

A stream protocol's drain waiters: asyncio.start_server's StreamReaderProtocol
keeps the futures of writers waiting in drain() in a deque, whose first block
is 760 bytes on every client connection, open or idle, though at most one
writer ever waits on a connection here. A list does what the deque is used for
(append, remove, iterate) in 80.

tests/test_asyncio_internals.py pins both attributes and their effect on the
Python it runs on.
"""

from __future__ import annotations

import asyncio
import collections


def release_closed_transport(transport: asyncio.BaseTransport | None) -> None:
    """Break a closing selector transport's self-reference; other transports untouched.

    Safe once the transport is closing: close() and abort() have removed its
    reader, so the callback is never called again.
    """
    if (transport is not None and getattr(transport, "_read_ready_cb", None) is not None
            and transport.is_closing()):
        transport._read_ready_cb = None  # type: ignore[attr-defined]


def slim_drain_waiters(protocol: asyncio.BaseProtocol) -> None:
    """Swap a stream protocol's empty deque of drain waiters for a list."""
    waiters = getattr(protocol, "_drain_waiters", None)
    if type(waiters) is collections.deque and not waiters:
        protocol._drain_waiters = []  # type: ignore[attr-defined]
