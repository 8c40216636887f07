"""The asyncio internals lowproxy touches: what a connection holds and what a read costs.

A selector transport's read callback:

On asyncio's own loop (not uvloop, whose transports are C objects) a socket
transport keeps its read callback as a bound method of itself
(``_SelectorSocketTransport._read_ready_cb``, CPython 3.10-3.13). Every such
transport is therefore in a reference cycle and outlives its close until the
cyclic GC's next full pass, with its socket objects and address tuples. After a
burst of short connections (a few hundred prefill legs opened at once, then
discarded because the idle pool is full) that is megabytes of RSS held for
minutes. Clearing the attribute once the transport is closing lets reference
counting free it at once. 3.12 adds a second one, the write callback
(``_write_ready``, a bound method kept on the instance); it clears both in
close() itself, but not in abort().

A stream protocol's drain waiters: asyncio.start_server's StreamReaderProtocol
keeps the futures of writers waiting in drain() in a deque, whose first block
is 760 bytes on every client connection, open or idle, though at most one
writer ever waits on a connection here. A list does what the deque is used for
(append, remove, iterate) in 80.

A selector transport's read size: asyncio's own loop reads with
``sock.recv(max_size)``, 256 KiB by default, above glibc's mmap threshold
(128 KiB): every read maps 256 KiB, remaps it to the bytes that came, and
unmaps them once consumed, three system calls and a page fault per read (an
SSE event, a request, a response head), about 16 µs on this machine against
2.4 for a 64 KiB read. 64 KiB comes from the heap and is shrunk in place; the
read-side flow control of both sides works in 64 KiB anyway. (uvloop reads
into a buffer it keeps: untouched.)

tests/test_asyncio_internals.py pins these attributes and their effect on the
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
    if transport is None or not transport.is_closing():
        return
    if getattr(transport, "_read_ready_cb", None) is not None:
        transport._read_ready_cb = None  # type: ignore[attr-defined]
    # 3.12+: an instance attribute (on 3.10 and 3.11 it is the class's method).
    if getattr(transport, "__dict__", {}).get("_write_ready") is not None:
        transport._write_ready = None  # type: ignore[attr-defined]


def slim_drain_waiters(protocol: asyncio.BaseProtocol) -> None:
    """Swap a stream protocol's empty deque of drain waiters for a list."""
    waiters = getattr(protocol, "_drain_waiters", None)
    if type(waiters) is collections.deque and not waiters:
        protocol._drain_waiters = []  # type: ignore[attr-defined]


# What asyncio's selector transports read at once (see above): the downstream
# and upstream read sizes.
TRANSPORT_READ_SIZE = 64 * 1024


def read_in_heap_sized_pieces(transport: asyncio.BaseTransport) -> None:
    """A selector transport reads TRANSPORT_READ_SIZE at most; other transports untouched."""
    size = getattr(transport, "max_size", None)
    if type(size) is int and size > TRANSPORT_READ_SIZE and hasattr(transport, "_read_ready_cb"):
        transport.max_size = TRANSPORT_READ_SIZE  # type: ignore[attr-defined]
