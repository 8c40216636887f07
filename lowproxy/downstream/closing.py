"""A client connection's end: waiting for its close to finish, bounded.

Used by the connection itself once it has closed, and by the server for a
connection it refuses at once (503: too many connections, shutting down).
"""

from __future__ import annotations

import asyncio

from ..asyncio_internals import release_closed_transport

# How long a closed connection may take to flush what it still has queued.
CLOSE_GRACE = 10.0


async def closed(writer: asyncio.StreamWriter) -> None:
    """Wait for a closed connection to be gone; abort one whose peer will not read.

    close() flushes what is queued first, which a client that stopped reading
    never lets happen: after CLOSE_GRACE the socket is aborted, so no fd
    outlives its client. Awaiting also collects the reset error asyncio keeps
    for a peer that reset, which it would otherwise report as never retrieved.
    """
    try:
        await asyncio.wait_for(writer.wait_closed(), CLOSE_GRACE)
    except asyncio.TimeoutError:
        writer.transport.abort()
    except (ConnectionError, OSError):
        pass
    release_closed_transport(writer.transport)
