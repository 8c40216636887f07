"""The UpstreamError family: how an exchange with a backend can fail.

A leaf at run time (it imports no lowproxy module), so that anything may catch
these without importing the pool. Callers tell failures apart by class, as with
httpcore's own exception family; ``reason`` is the same said as a stable word,
for log lines. The pool (pool.py) raises them; dispatch also names its own
decode first-byte timeout with an UpstreamTimeout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only a type here: at run time this module imports nothing
    from .endpoint import Endpoint


class UpstreamError(Exception):
    """An upstream exchange that failed.

    ``reason`` is one of ``unreachable`` (refused, no route, TLS verification
    failed: nothing was sent), ``untrusted`` (the CA file is unusable: nothing
    may be sent to any https backend), ``timeout``, ``protocol`` (the backend
    broke HTTP or hung up). ``request_sent`` says whether bytes of the request
    were handed to the connection: when False the backend cannot have acted on
    it, and it may go to another endpoint without running twice. ``endpoint``
    is the Endpoint the exchange was with.
    """

    reason = "protocol"
    request_sent = True

    def __init__(self, detail: str, endpoint: Endpoint | None = None, *,
                 request_sent: bool | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.endpoint = endpoint
        if request_sent is not None:
            self.request_sent = request_sent


class UpstreamUnreachable(UpstreamError):
    """No connection: refused, no route, connect timeout, TLS handshake refused."""

    reason = "unreachable"
    request_sent = False


class UpstreamUntrusted(UpstreamError):
    """The CA bundle is unusable, so no https backend may be spoken to."""

    reason = "untrusted"
    request_sent = False


class UpstreamTimeout(UpstreamError):
    """A read or write towards the backend outlived its bound."""

    reason = "timeout"


class UpstreamProtocolError(UpstreamError):
    """The backend broke HTTP/1.1, broke off its response, or hung up."""


class UpstreamClosed(UpstreamProtocolError):
    """The backend closed or reset the connection before any byte of its answer."""


class UpstreamNotRetried(UpstreamClosed):
    """The request was sent on a reused connection that the backend then closed,
    and it is not replayable, so it was not sent again: the backend may have
    acted on it (RFC 9110 section 9.2.2)."""
