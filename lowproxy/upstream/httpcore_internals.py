"""Every httpcore internal lowproxy relies on, named here and nowhere else.

httpcore owns each upstream connection: an ``AsyncHTTP11Connection`` is built
over the stream lowproxy dialled (stream.AsyncioBackend, TLS with the
endpoint's explicit ``ssl.SSLContext``), and it keeps the connection's h11
state. lowproxy drives the request/response cycle on that state itself
(cycle.py): httpcore's request API costs a Request, a URL, trace
hooks, a lock and several generator hops per request, about 110 µs of the two
cycles a PD request makes (issue 21).

What is relied on, each pinned by tests/upstream/test_httpcore_fence.py:

- ``AsyncHTTP11Connection(origin, stream, keepalive_expiry=...)`` does no I/O;
- ``AsyncHTTP11Connection._h11_state``: an ``h11.Connection`` in the CLIENT
  role, fresh (both sides IDLE), with httpcore's head-size bound;
- ``AsyncHTTP11Connection._network_stream``: the stream it was built over;
- ``AsyncHTTP11Connection.MAX_INCOMPLETE_EVENT_SIZE``: that bound, which
  lowproxy applies to response heads too (they reach h11 only whole).

The upper bound on httpcore in pyproject.toml stays below a release that
changes any of them until this module is adapted.
"""

from __future__ import annotations

import h11
import httpcore

from .stream import AsyncioStream

# The largest response head accepted (httpcore's, and so h11's, bound).
MAX_HEAD_BYTES: int = httpcore.AsyncHTTP11Connection.MAX_INCOMPLETE_EVENT_SIZE


def adopt(origin: httpcore.Origin, stream: AsyncioStream, keepalive_expiry: float | None
          ) -> tuple[httpcore.AsyncHTTP11Connection, h11.Connection]:
    """httpcore's connection over ``stream``, and the h11 state it keeps for it."""
    http = httpcore.AsyncHTTP11Connection(origin, stream, keepalive_expiry=keepalive_expiry)
    state: h11.Connection = http._h11_state
    if http._network_stream is not stream:  # pragma: no cover - fenced
        raise RuntimeError("httpcore no longer keeps the stream it was given")
    return http, state
