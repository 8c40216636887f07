"""Pure checks on a parsed request head, added to h11's own.

h11 parses what RFC 9112 allows an origin server to accept; a proxy must be
stricter, because a parser on another hop may frame the same bytes
differently (request smuggling). Nothing here does I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import h11

from .._types import Headers

ALLOWED_METHODS = (b"GET", b"POST", b"HEAD", b"OPTIONS")

# RFC 9112 3: servers should take request lines of at least 8000 octets; a
# longer target is answered 414 (RFC 9110 15.5.15), as nginx's and Go's do.
MAX_TARGET_BYTES = 8 * 1024

# RFC 9112 3.2 / RFC 3986 3.2.2: Host = uri-host [ ":" port ]; uri-host is an IP
# literal in brackets or a reg-name (unreserved, pct-encoded, sub-delims), which
# may be empty. Anything else (spaces, "@" userinfo, "/", a second ":") is 400.
_HOST = re.compile(rb"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._~!$&'()*+,;=%-]*)(?::[0-9]*)?")
# RFC 9112 3.2.2 absolute-form: scheme "://" authority, then path-abempty and query.
_ABSOLUTE = re.compile(rb"(?i:https?)://([^/?#]*)([^#]*)")


@dataclass(frozen=True)
class Limits:
    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 32 * 1024 * 1024
    header_timeout: float = 30.0
    tls_handshake_timeout: float = 10.0  # from accept to a finished TLS handshake
    keepalive_timeout: float = 75.0
    max_connections: int = 10000
    # A client that takes nothing of a full write buffer for this long is gone
    # (nginx's send_timeout): else it holds its decode leg, and the slot, for ever.
    write_timeout: float | None = 60.0


# (status, message, error type[, extra headers]): the arguments of a refusal.
Refusal = tuple[Any, ...]


def refusal(event: h11.Request, head_reads: list[bytes], head_size: int,
            limits: Limits, headers: Headers | None = None) -> Refusal | None:
    """Why a parsed request head is refused; None to serve it.

    ``headers``: the event's headers with lowercase names, when the caller has
    them already (h11's Headers iterates item by item through Sequence's
    generic ``__iter__``)."""
    if event.http_version not in (b"1.0", b"1.1"):
        return 505, "HTTP version not supported", "bad_request"
    if event.method not in ALLOWED_METHODS:
        return (405, "method not allowed", "method_not_allowed",
                [(b"allow", b", ".join(ALLOWED_METHODS))])
    if len(event.target) > MAX_TARGET_BYTES:
        return 414, "request target too long", "uri_too_long"
    if head_size > limits.max_header_bytes:
        return 431, "request header fields too large", "header_too_large"
    if event.target[:1] != b"/":
        problem = target_problem(event.method, event.target)
        if problem:
            return 400, f"malformed request: {problem}", "bad_request"
    declared = None
    chunked = False
    for name, value in event.headers if headers is None else headers:
        if name == b"content-length":
            declared = int(value)
        elif name == b"transfer-encoding":
            chunked = True
        elif name == b"host" and not _HOST.fullmatch(value):
            # h11 already refuses a missing (HTTP/1.1) or repeated Host.
            return 400, "malformed request: invalid Host header", "bad_request"
    if declared is not None and chunked:
        # RFC 9112 6.3: a request smuggling vector; h11 would take chunked.
        return 400, "Content-Length with Transfer-Encoding", "bad_request"
    if chunked and event.http_version == b"1.0":
        # RFC 9112 6.1: an HTTP/1.0 message with Transfer-Encoding has faulty
        # framing (a 1.0 hop before us may have framed it otherwise).
        return 400, "Transfer-Encoding in HTTP/1.0", "bad_request"
    problem = head_problem(head_reads, head_size, declared is not None)
    if problem:
        return 400, f"malformed request: {problem}", "bad_request"
    if declared is not None and declared > limits.max_body_bytes:
        return 413, "request body too large", "request_too_large"
    return None


def head_problem(reads: list[bytes], size: int, has_length: bool) -> str | None:
    """What h11 forgives in a request head that a proxy must refuse; None if nothing.

    h11 joins obs-fold continuation lines, merges repeated equal Content-Length
    values and takes a bare LF for a line end. An origin server may (RFC 9112
    5.2 and 2.2, RFC 9110 8.6), but a proxy refuses them. ``reads`` hold the
    head in their first ``size`` bytes.
    """
    head = reads[0] if len(reads) == 1 else b"".join(reads)
    if head.find(b"\n ", 0, size) >= 0 or head.find(b"\n\t", 0, size) >= 0:
        return "obsolete line folding"
    if head.count(b"\n", 0, size) != head.count(b"\r\n", 0, size):
        # A bare LF ends a line for h11 (RFC 9112 2.2 lets it) but not for a hop
        # that splits on CRLF only: the two would frame the body apart.
        return "line ending without CR"
    if has_length:
        lowered = head[:size].lower()
        start = lowered.find(b"\ncontent-length:")
        if lowered.find(b"\ncontent-length:", start + 1) >= 0:
            return "repeated Content-Length"
        if b"," in lowered[start:lowered.find(b"\n", start + 1)]:
            return "Content-Length list"
    return None


def target_problem(method: bytes, target: bytes) -> str | None:
    """Why a request-target not in origin-form is refused; None for a usable one.

    RFC 9112 3.2: asterisk-form is for OPTIONS only; absolute-form must be
    accepted by a server (3.2.2) and is reduced to origin-form by
    origin_target(); authority-form is CONNECT's, which is refused anyway.
    """
    if target == b"*":
        return None if method == b"OPTIONS" else "'*' target is only for OPTIONS"
    match = _ABSOLUTE.fullmatch(target)
    if match is None:
        return "request target is not origin-form or absolute-form"
    authority = match.group(1)
    if not authority or not _HOST.fullmatch(authority):
        # Empty, or with userinfo (RFC 9110 4.2.4: treat as an error).
        return "absolute-form target with an invalid authority"
    return None


def origin_target(target: bytes) -> bytes:
    """The target as origin-form: an absolute-form one reduced to path and query.

    The authority is never forwarded (RFC 9112 3.2.2: the server uses the
    target's host instead of Host; the proxy sets its own Host upstream).
    Call only on a target refusal() has let through.
    """
    if target[:1] == b"/" or target == b"*":
        return target
    match = _ABSOLUTE.fullmatch(target)
    assert match is not None, target
    rest = match.group(2)
    return rest if rest[:1] == b"/" else b"/" + rest


def oversized_head_status(reads: list[bytes], limits: Limits) -> int:
    """414 or 431 for a head h11 found larger than its limit before it ended.

    h11 counts the request line into its one size limit, so a long target
    shows as "header too large"; if the request line itself has not ended
    within the limit, or is longer than MAX_TARGET_BYTES allows, the target
    is what is too long.
    """
    head = reads[0] if len(reads) == 1 else b"".join(reads)
    end = head.find(b"\n", 0, limits.max_header_bytes + 1)
    line_limit = MAX_TARGET_BYTES + len(b"OPTIONS  HTTP/1.1\r")
    return 414 if end < 0 or end > line_limit else 431
