"""What crosses each hop: request headers forwarded upstream, response headers relayed.

Header values travel as the peer's raw bytes in both directions (non-ASCII
included): h11 hands them to us as bytes and we never decode them, so nothing
is transcoded. Names arrive lowercased from h11.
"""

from __future__ import annotations

from collections.abc import Iterable

from ._types import Headers

# End-to-end request headers a model server may act on. Everything else (cookies,
# authorization, proxy headers, x-prefiller-host-port, content-length, host,
# content-encoding: the body is re-serialised) stops at the proxy, as in the
# GCO proxy. The proxy sets host, content-length and the trace headers itself.
FORWARDED_REQUEST_HEADERS = frozenset(
    {
        b"accept",
        b"accept-encoding",
        b"cache-control",
        b"content-type",
        b"idempotency-key",
        b"if-match",
        b"if-none-match",
        b"prefer",
        b"range",
        b"user-agent",
        b"x-request-id",
    }
)

# Hop-by-hop headers (RFC 9110 section 7.6.1, and the list Go's ReverseProxy
# strips). Framing headers are the proxy's own: content-length is dropped too and
# the client side re-frames what it relays.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
    }
)


def forwarded_request_headers(headers: Iterable[tuple[bytes, bytes]]) -> Headers:
    """The client's headers that may reach a backend, in order, bytes unchanged.

    A header the client's Connection names is hop-by-hop (RFC 9110 7.6.1) and
    stops here even when it is on the allow list.
    """
    headers = list(headers)
    forwarded = [(name, value) for name, value in headers if name in FORWARDED_REQUEST_HEADERS]
    named = connection_tokens(headers)
    if named:
        forwarded = [(name, value) for name, value in forwarded if name not in named]
    return forwarded


def header_value(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of ``name`` (lowercase) in ``headers``, or None."""
    for key, value in headers:
        if key == name:
            return value
    return None


def connection_tokens(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """Header names listed in Connection: they are hop-by-hop too (RFC 9110 7.6.1)."""
    tokens: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            tokens.update(t.strip().lower() for t in value.split(b",") if t.strip())
    return frozenset(tokens)


def relayed_response_headers(headers: Iterable[tuple[bytes, bytes]]) -> Headers:
    """Upstream response headers minus hop-by-hop ones; repeats kept, bytes unchanged."""
    headers = list(headers)
    named = connection_tokens(headers)
    relayed = []
    for name, value in headers:
        lowered = name.lower()
        if lowered in HOP_BY_HOP or lowered in named:
            continue
        relayed.append((lowered, value))
    return relayed


def body_framing(headers: Iterable[tuple[bytes, bytes]]) -> tuple[int | None, bool]:
    """A response's Content-Length (None without one) and whether Transfer-Encoding
    frames its body. Transfer-Encoding beats Content-Length (RFC 9112 section 6.3,
    as h11 frames it): a length sent beside it describes nothing, so it is None."""
    content_length = None
    framed_by_transfer_encoding = False
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"content-length":
            content_length = int(value)
        elif lowered == b"transfer-encoding":
            framed_by_transfer_encoding = True
    return (None if framed_by_transfer_encoding else content_length,
            framed_by_transfer_encoding)


def client_response_head(headers: Iterable[tuple[bytes, bytes]],
                         streamed: bool) -> tuple[Headers, int | None]:
    """Decode's response headers as the client gets them, and decode's content-length.

    The content type is decode's (application/json when it sent none), or
    text/event-stream for a request that asked to stream and was answered 2xx
    (``streamed``), whatever decode said (as the GCO proxy answered). The
    length is kept so a body cut short shows, unless decode also sent
    Transfer-Encoding: then the body is framed by that and the length describes
    nothing (RFC 9112 section 6.3); relaying it would frame the client's body by
    a number the body does not match.
    """
    headers = list(headers)
    content_length, _ = body_framing(headers)
    content_type = b"application/json"
    relayed = []
    for name, value in relayed_response_headers(headers):
        if name == b"content-type":
            content_type = value
        else:
            relayed.append((name, value))
    relayed.append((b"content-type", b"text/event-stream" if streamed else content_type))
    return relayed, content_length
